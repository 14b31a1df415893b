"""The Mooncake guide's proxy command line, verbatim: ``python proxy/proxy_server.py``, no flags.

It must serve on port 8000 with prefill ``http://localhost:8100`` and decode
``http://localhost:8200`` and say so in its first log line. The backends here are the proxy
benchmark's instant OpenAI-shaped servers (``benchmarks.fake_backend``) on those two ports, so
the test takes a couple of seconds; it is skipped when another program holds one of the ports.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from benchmarks.fake_backend import make_app
from mooncake_vllm.proxy.server import GUIDE_DECODE, GUIDE_PREFILL, parse_args

REPO = Path(__file__).resolve().parent.parent
GUIDE_PORTS = (8000, 8100, 8200)


def test_no_flags_means_the_guide_backends():
    cfg = parse_args([])
    assert (cfg.host, cfg.port) == ("127.0.0.1", 8000)
    assert (cfg.prefill, cfg.decode) == (["http://localhost:8100"], ["http://localhost:8200"])
    assert (GUIDE_PREFILL, GUIDE_DECODE) == ("http://localhost:8100", "http://localhost:8200")
    # A flag given replaces its default only.
    cfg = parse_args(["--prefill", "http://127.0.0.9:1"])
    assert (cfg.prefill, cfg.decode) == (["http://127.0.0.9:1"], ["http://localhost:8200"])


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


async def _wait_for(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"proxy exited with {proc.returncode}")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{url} not healthy within {timeout_s}s")
            await asyncio.sleep(0.1)


async def test_guide_command_line_serves_on_8000_and_says_so_first():
    taken = [p for p in GUIDE_PORTS if _port_taken(p)]
    if taken:
        pytest.skip(f"port(s) {taken} in use by another program")
    runners = []
    for port in (8100, 8200):
        runner = web.AppRunner(make_app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "localhost", port).start()
        runners.append(runner)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "proxy/proxy_server.py"],  # the guide's line, verbatim
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        await _wait_for("http://127.0.0.1:8000/health", proc, timeout_s=60)
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                "http://localhost:8000/v1/completions", json={"prompt": "hi", "max_tokens": 4}
            ) as resp,
        ):
            assert resp.status == 200
            answer = await resp.json()
        assert answer["choices"][0]["text"] == " ok ok ok ok"
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.to_thread(proc.communicate, timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for runner in runners:
            await runner.cleanup()
    assert proc.returncode == 0, output
    first_line = output.splitlines()[0]
    assert "serving on http://127.0.0.1:8000" in first_line, output
    assert "prefill http://localhost:8100" in first_line and "decode http://localhost:8200" in (
        first_line
    ), output
