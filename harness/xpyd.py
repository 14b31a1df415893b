"""The proxy as a real process, and what its ``/health`` says about its pools.

Shared by every test that runs the proxy as a user does: ``proxy/proxy_server.py`` (the command a
user types) in its own process group, logging to a file like every other harness server.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.servers import ManagedProcess, default_log_dir, free_port, metric_sum

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(eq=False)
class ProxyServer:
    process: ManagedProcess
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def health(self) -> dict[str, Any]:
        """The proxy's ``/health`` report (200 or 503 alike): status and each pool's backends."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:  # 503: some pool has no healthy backend
            return json.loads(e.read())

    def pool(self, role: str, healthy_only: bool = False) -> set[str]:
        """URLs in the ``role`` pool (only those in rotation with ``healthy_only``)."""
        return {b["url"] for b in self.health()[role] if b["healthy"] or not healthy_only}

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the proxy's ``/metrics``, summed over the series whose labels include
        ``labels``."""
        return metric_sum(f"{self.url}/metrics", name, **labels)

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float) -> float:
        """Seconds until ``check()`` holds; AssertionError naming ``what`` at the deadline."""
        start = time.monotonic()
        while not check():
            if time.monotonic() - start > timeout_s:
                health = self.health()
                raise AssertionError(f"{what}: not within {timeout_s:.0f}s; /health {health}")
            time.sleep(0.1)
        return time.monotonic() - start

    def stop(self) -> None:
        self.process.stop(grace_s=10)


def start_proxy(
    args: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_dir: Path | None = None,
    timeout_s: float = 60.0,
) -> ProxyServer:
    """``python proxy/proxy_server.py ARGS --host H --port P``, up when ``/health`` answers."""
    port = port or free_port(host)
    argv = [sys.executable, str(REPO_ROOT / "proxy" / "proxy_server.py"), *args]
    argv += ["--host", host, "--port", str(port)]
    log = (log_dir or default_log_dir()) / f"proxy-{host}-{port}.log"
    # This checkout's package, not whichever one is installed (the script's own fallback).
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = ManagedProcess("proxy", argv, log, env).start()
    server = ProxyServer(proc, host, port)
    proc.wait_until(lambda: "status" in server.health(), timeout_s, "answering /health")
    return server


def start_pair_proxy(prefill_url: str, decode_url: str, timeout_s: float = 60.0) -> ProxyServer:
    """``proxy_server.py --prefill P --decode D`` in front of one pair, as the README starts it;
    returned once both backends are in rotation (``/health`` says ``ok``)."""
    proxy = start_proxy(["--prefill", prefill_url, "--decode", decode_url], timeout_s=timeout_s)
    try:
        proxy.wait_for(
            "both backends in rotation", lambda: proxy.health()["status"] == "ok", timeout_s
        )
    except BaseException:
        proxy.stop()
        raise
    return proxy
