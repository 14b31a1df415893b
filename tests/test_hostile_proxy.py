"""What a hostile or broken client can send the proxy, and what it gets back: every request
answered, bounded and counted, and the proxy still serving the next one.

The proxy runs for real (in the test's loop, ``start_proxy``; as a subprocess where its memory is
measured) in front of one small fake backend playing both pools; clients are raw sockets on
127.0.0.1 where an HTTP client would not send what a hostile one does. No vLLM is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp import web

from harness.local_proxy import start_app, wait_for_listener
from harness.servers import free_port
from mooncake_vllm.metadata import redact_url
from mooncake_vllm.proxy.http_head import MAX_HEAD_BYTES, BoundedHttpToolsProtocol
from mooncake_vllm.proxy.server import parse_args, startup_line

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


# ---- a fake backend, both roles -----------------------------------------------------------------


@dataclass(eq=False)
class Backend:
    """An OpenAI-shaped completions server: a prefill leg (``do_remote_decode``) gets a handoff,
    a decode leg a completion. ``hold_prefills``: a prefill leg waits until more than that many
    are in flight (never, under the proxy's bound) or a moment has passed."""

    hold_prefills: int | None = None
    requests: int = 0
    prefills_in_flight: int = 0
    most_prefills_in_flight: int = 0
    _crowded: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Backend:
        app = web.Application(client_max_size=64 * MiB)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", lambda _: web.json_response({}))
        self._runner, self.port = await start_app(app)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _complete(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = msgspec.json.decode(await request.read())
        prompt = body["prompt"]
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            self.prefills_in_flight += 1
            self.most_prefills_in_flight = max(
                self.most_prefills_in_flight, self.prefills_in_flight
            )
            try:
                if self.hold_prefills is not None:
                    if self.prefills_in_flight > self.hold_prefills:
                        self._crowded.set()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._crowded.wait(), 0.2)
            finally:
                self.prefills_in_flight -= 1
            return web.json_response(
                {"choices": [{"index": 0, "text": "."}], "kv_transfer_params": {"t": prompt}}
            )
        return web.json_response(
            {"id": "c", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": f"<{prompt}>", "finish_reason": "length"}]}
        )  # fmt: skip


@pytest.fixture
async def backend(start_fake) -> Backend:
    return await start_fake(Backend)


@pytest.fixture
def proxy(start_proxy, backend):
    """``await proxy(**config)`` → the URL of a proxy in front of ``backend`` (both pools)."""
    return lambda **config: start_proxy(prefill=[backend.url], decode=[backend.url], **config)


# ---- a raw client -------------------------------------------------------------------------------


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = int(url.rsplit(":", 1)[1])
    return await asyncio.open_connection("127.0.0.1", port)


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and body of one answer (a ``content-length`` body); 10 s at most: a proxy
    that holds the connection fails the test instead of hanging it."""

    async def read() -> tuple[int, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await reader.readexactly(length)

    return await asyncio.wait_for(read(), timeout=10)


def _head(path: str = "/v1/completions", *, content_length: int, extra: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n".encode()
        + extra
        + b"\r\n"
    )


async def _metric(session: aiohttp.ClientSession, url: str, status: int) -> float:
    """``mooncake_proxy_requests_total`` for /v1/completions answered ``status``."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if (
            line.startswith("mooncake_proxy_requests_total{")
            and 'endpoint="/v1/completions"' in (line)
            and f'status="{status}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- 2: a prompt list is bounded in prompts and in legs at once ---------------------------------


async def test_a_list_past_max_prompts_is_refused_naming_the_flag(proxy, backend):
    url = await proxy(max_prompts=4)
    async with aiohttp.ClientSession() as session:
        body = {"prompt": [f"p{i}" for i in range(5)], "max_tokens": 2}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["param"] == "prompt" and "--max-prompts" in error["message"]
        assert "5 prompts" in error["message"]
        assert backend.requests == 0  # refused before any leg
        body["prompt"] = body["prompt"][:4]
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert len((await resp.json())["choices"]) == 4


async def test_a_prompt_list_sends_at_most_its_concurrency_of_legs_at_once(start_fake, start_proxy):
    """20 distinct prompts under the default --prompt-list-concurrency (8): the backend never
    sees a ninth prefill leg while eight are in flight (before: all 20 at once)."""
    backend = await start_fake(Backend, hold_prefills=8)
    url = await start_proxy(prefill=[backend.url], decode=[backend.url])
    async with aiohttp.ClientSession() as session:
        body = {"prompt": [f"p{i}" for i in range(20)], "max_tokens": 2}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            texts = [c["text"] for c in (await resp.json())["choices"]]
    assert texts == [f"<p{i}>" for i in range(20)]
    assert backend.most_prefills_in_flight == 8


def _peak_rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


async def test_memory_stays_near_one_body_for_a_header_flood_and_a_list(backend):
    """The proxy as a subprocess, its peak RSS read from /proc: 32 MiB of headers on one
    connection, then 48 prompts beside 1 MiB of shared fields (legs carrying 96 MiB in all)."""
    port = free_port()
    argv = [sys.executable, "-m", "mooncake_vllm.proxy.server", "--prefill", backend.url,
            "--decode", backend.url, "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_for_listener(url, timeout_s=60)
        async with aiohttp.ClientSession() as session:
            warm = {"prompt": ["a", "b"], "max_tokens": 2, "user": "x" * 1024}
            async with session.post(url + "/v1/completions", json=warm) as resp:
                assert resp.status == 200
            before = _peak_rss_bytes(proc.pid)

            reader, writer = await _connect(url)
            writer.write(_head(content_length=2, extra=b"X-Flood: "))
            sent = 0
            try:
                while sent < 32 * MiB:
                    writer.write(b"a" * MiB)
                    await writer.drain()
                    sent += MiB
                status, _ = await _read_answer(reader)
                assert status == 431
            except ConnectionError:
                pass  # reset: the proxy closed with the flood's bytes still arriving
            writer.close()
            assert sent < 32 * MiB  # cut off: the proxy took no more than the bound
            grown = _peak_rss_bytes(proc.pid) - before
            assert grown < 8 * MiB, f"the proxy grew by {grown / MiB:.0f} MiB (headers)"

            before = _peak_rss_bytes(proc.pid)
            body = {"prompt": [f"p{i}" for i in range(48)], "max_tokens": 2, "user": "x" * MiB}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert len((await resp.json())["choices"]) == 48
            grown = _peak_rss_bytes(proc.pid) - before
            # 8 legs at once, each with its bytes, their copy in the request and what the socket
            # has not taken yet: ~18 MiB measured (all 48 at once: ~100 MiB).
            assert grown < 48 * MiB, f"the proxy grew by {grown / MiB:.0f} MiB (prompt list)"
            async with session.post(url + "/v1/completions", json=warm) as resp:
                assert resp.status == 200  # and it serves the next client
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---- 3: the request head is bounded in size, lines and time -------------------------------------


async def test_a_head_past_its_size_is_answered_431_and_the_connection_closed(proxy):
    url = await proxy()
    reader, writer = await _connect(url)
    writer.write(_head(content_length=2, extra=b"X-Big: " + b"a" * (MAX_HEAD_BYTES + 1)))
    status, body = await _read_answer(reader)
    assert status == 431 and str(MAX_HEAD_BYTES).encode() in body
    assert await asyncio.wait_for(reader.read(), timeout=10) == b""  # closed: nothing kept
    writer.close()


async def test_too_many_header_lines_are_answered_431(proxy):
    url = await proxy()
    reader, writer = await _connect(url)
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(BoundedHttpToolsProtocol.max_headers))
    writer.write(_head(content_length=2, extra=lines) + b"{}")
    status, body = await _read_answer(reader)
    assert status == 431 and b"header lines" in body
    writer.close()


async def test_a_head_that_never_ends_is_answered_408(proxy, monkeypatch):
    monkeypatch.setattr(BoundedHttpToolsProtocol, "head_timeout_s", 0.3)
    url = await proxy()
    reader, writer = await _connect(url)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nX-Slow: a")  # no blank line
    status, body = await _read_answer(reader)
    assert status == 408 and b"request head" in body
    assert await asyncio.wait_for(reader.read(), timeout=10) == b""
    writer.close()
    idle_reader, idle_writer = await _connect(url)  # a connection that sends nothing at all
    assert (await _read_answer(idle_reader))[0] == 408
    idle_writer.close()


async def test_a_normal_request_with_its_body_in_the_same_read_is_served(proxy):
    """The head bound counts head bytes only: a body that arrives with the head, larger than
    the bound, is the body's (``--max-body-bytes``)."""
    url = await proxy()
    body = json.dumps({"prompt": "x" * (2 * MAX_HEAD_BYTES), "max_tokens": 1}).encode()
    reader, writer = await _connect(url)
    writer.write(_head(content_length=len(body)) + body)
    status, _ = await _read_answer(reader)
    assert status == 200
    writer.close()


# ---- 4: a body that never comes -----------------------------------------------------------------


@pytest.mark.parametrize("sent", [b"", b'{"prompt": "x"'], ids=["no-body", "half-a-body"])
async def test_a_body_that_never_comes_is_answered_408_and_frees_the_slot(proxy, sent):
    url = await proxy(body_timeout_s=0.3, client_max_concurrency=1)
    reader, writer = await _connect(url)
    writer.write(_head(content_length=100) + sent)
    status, body = await _read_answer(reader)
    assert status == 408
    assert "--body-timeout-s" in json.loads(body)["error"]["message"]
    writer.close()
    async with (
        aiohttp.ClientSession() as session,  # the same client: its slot is free
        session.post(url + "/v1/completions", json={"prompt": "x"}) as resp,
    ):
        assert resp.status == 200


# ---- 14: a client that leaves mid-body; nesting too deep ----------------------------------------


async def test_a_client_leaving_mid_body_is_info_and_counted_499_not_500(proxy, caplog):
    caplog.set_level(logging.INFO, logger="mooncake_vllm.proxy")
    url = await proxy()
    _, writer = await _connect(url)
    writer.write(_head(content_length=1000) + b'{"prompt": "')
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    async with aiohttp.ClientSession() as session:
        for _ in range(200):  # until the proxy has seen it go (10 s at most)
            if await _metric(session, url, 499) == 1:
                break
            await asyncio.sleep(0.05)
        assert await _metric(session, url, 499) == 1
        assert await _metric(session, url, 500) == 0
    proxy_records = [r for r in caplog.records if r.name.startswith("mooncake_vllm")]
    assert not [r for r in proxy_records if r.levelno >= logging.WARNING]
    assert any("left before its request body" in r.getMessage() for r in proxy_records)


async def test_deeply_nested_json_is_a_400_naming_the_problem(proxy):
    url = await proxy()
    async with aiohttp.ClientSession() as session:
        data = b"[" * 100_000 + b"]" * 100_000
        async with session.post(
            url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 400
            assert "nested too deeply" in (await resp.json())["error"]["message"]


# ---- 15: no credential in a log line ------------------------------------------------------------

SECRET = "s3cr3t-value"


@pytest.mark.parametrize(
    "param",
    ["password", "passwd", "pwd", "token", "access_token", "api_key", "apikey", "key", "secret",
     "client_secret", "auth", "sig", "signature", "X-Amz-Signature", "x-api-key"],
)  # fmt: skip
def test_redact_url_hides_every_common_credential_parameter(param):
    shown = redact_url(f"http://h:8080/metadata?x=1&{param}={SECRET}&y=2")
    assert shown == f"http://h:8080/metadata?x=1&{param}=***&y=2"
    assert redact_url(f"http://h/m?{param}={SECRET}") == f"http://h/m?{param}=***"


@pytest.mark.parametrize("url", ["http://h/m?monkey=1&keys=2&author=3", "etcd://h:2379", "h:2379"])
def test_redact_url_leaves_other_parameters(url):
    assert redact_url(url) == url


def test_the_startup_line_shows_the_registry_without_its_credentials():
    cfg = parse_args(["--discover", f"http://app:{SECRET}@127.0.0.1:8080/metadata?token={SECRET}"])
    line = startup_line(cfg)
    assert SECRET not in line
    assert "http://***@127.0.0.1:8080/metadata?token=***" in line
