"""The proxy's HTTP/1.1 leg client (``mooncake_vllm.proxy.http1``) against real sockets: servers
written here answer byte by byte as each case needs (keep-alive, streams, broken answers)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from harness.tls import make_pki
from mooncake_vllm.proxy import http1
from mooncake_vllm.proxy.errors import FailureKind, LegDeadline, classify

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server on loopback; yields its URL and the client ports it accepted, in order."""
    peers: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[1])
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", peers


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def _answer(body: bytes, *, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n" + extra
        + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


async def _echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        _, body = await _read_request(reader)
        writer.write(_answer(b'{"echo": %d}' % len(body)))
        await writer.drain()


def _client(**kw) -> http1.Client:
    return http1.Client(
        keepalive_s=kw.get("keepalive_s", 4.0),
        connect_timeout_s=kw.get("connect_timeout_s", 2.0),
        limit_per_host=kw.get("limit_per_host", 100),
    )


async def _open(client: http1.Client, url: str, timeout_s: float = 5.0) -> http1.Response:
    """A bodiless POST to /s, its answer's head read."""
    return await client.request("POST", url, "/s", headers={}, body=b"", timeout_s=timeout_s)


async def _call(client: http1.Client, url: str, body: bytes = b"{}", timeout_s: float = 5.0):
    resp = await client.request(
        "POST", url, "/v1/completions", headers={"X-Request-Id": "r"}, body=body,
        timeout_s=timeout_s,
    )  # fmt: skip
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


def _deadline() -> LegDeadline:
    return LegDeadline(5.0, 5.0, "--timeout-s")


async def test_a_connection_is_kept_and_reused_and_the_request_is_whole():
    seen: list[bytes] = []

    async def handler(reader, writer):
        while True:
            head, body = await _read_request(reader)
            seen.append(head + body)
            writer.write(_answer(b'{"ok": true}'))

    async with _server(handler) as (url, peers):
        client = _client()
        for _ in range(3):
            assert await _call(client, url, b'{"prompt": "x"}') == (200, b'{"ok": true}')
        await client.close()
    assert len(peers) == 1  # one connection for the three calls
    host = url.removeprefix("http://").encode()
    assert seen[0] == (
        b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nX-Request-Id: r\r\n"
        b'Content-Length: 15\r\n\r\n{"prompt": "x"}'
    )


async def test_a_connection_idle_past_keepalive_is_not_reused():
    async with _server(_echo_forever) as (url, peers):
        client = _client(keepalive_s=0.2)
        await _call(client, url)
        await _call(client, url)
        await asyncio.sleep(0.4)
        await _call(client, url)
        await client.close()
    assert len(peers) == 2


async def test_a_connection_the_server_closed_while_idle_is_replaced_without_a_failure():
    async def once(reader, writer):
        await _read_request(reader)
        writer.write(_answer(b"{}"))
        await writer.drain()  # then close: the keep-alive connection goes while idle

    async with _server(once) as (url, peers):
        client = _client()
        await _call(client, url)
        await asyncio.sleep(0.2)
        assert await _call(client, url) == (200, b"{}")
        await client.close()
    assert len(peers) == 2


async def test_no_listener_is_a_connect_failure_that_classifies_as_connect():
    async with _server(_echo_forever) as (url, _):
        pass  # closed: nothing listens on its port now
    client = _client()
    with pytest.raises(http1.ConnectFailed) as caught:
        await _call(client, url)
    failure = classify(caught.value, "prefill", url, _deadline())
    assert failure is not None and failure.kind is FailureKind.CONNECT
    assert f"cannot connect to prefill backend {url}" in failure.message


async def test_the_deadline_covers_the_answer_and_closes_the_connection():
    gone = asyncio.Event()

    async def silent(reader, writer):
        await _read_request(reader)
        await reader.read()  # until the client closes
        gone.set()

    async with _server(silent) as (url, _):
        client = _client()
        with pytest.raises(asyncio.TimeoutError) as caught:
            await _call(client, url, timeout_s=0.3)
        await asyncio.wait_for(gone.wait(), 5)  # the server saw the connection go
        failure = classify(caught.value, "decode", url, LegDeadline(0.3, 0.3, "--timeout-s"))
        assert failure is not None and failure.kind is FailureKind.TIMEOUT


async def test_the_deadline_also_covers_a_stream_s_body():
    async def slow_stream(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await reader.read()

    async with _server(slow_stream) as (url, _):
        client = _client()
        resp = await _open(client, url, timeout_s=0.3)
        assert await resp.read_some() == b"hello"
        with pytest.raises(asyncio.TimeoutError):
            await resp.read_some()
        resp.close()


async def test_a_chunked_stream_is_read_as_it_arrives_and_released_for_reuse():
    async def stream(reader, writer):
        while True:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
            for event in (b"data: 1\n\n", b"data: 2\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")

    async with _server(stream) as (url, peers):
        client = _client()
        for _ in range(2):
            resp = await _open(client, url)
            assert resp.content_type == "text/event-stream"
            chunks = []
            while chunk := await resp.read_some():
                chunks.append(chunk)
            assert chunks == [b"data: 1\n\n", b"data: 2\n\n"]
            resp.release()
        await client.close()
    assert len(peers) == 1


async def test_close_drops_the_connection_mid_answer_and_release_of_a_partial_answer_too():
    drops = 0

    async def stream(reader, writer):
        nonlocal drops
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
        await writer.drain()
        if await reader.read() == b"":
            drops += 1

    async with _server(stream) as (url, peers):
        client = _client()
        for end in (http1.Response.close, http1.Response.release):
            resp = await _open(client, url)
            assert await resp.read_some() == b"one"
            end(resp)
            assert resp.ended
        await asyncio.sleep(0.2)
        await client.close()
    assert drops == 2 and len(peers) == 2


async def test_a_connection_cut_mid_body_is_a_drop_after_the_bytes_that_came():
    async def cut(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()

    async with _server(cut) as (url, _):
        client = _client()
        resp = await _open(client, url)
        assert await resp.read_some() == b"partial"
        with pytest.raises(http1.ConnectionDropped) as caught:
            await resp.read_some()
        resp.close()
    failure = classify(caught.value, "decode", url, _deadline())
    assert failure is not None and failure.kind is FailureKind.DISCONNECT
    assert f"decode backend {url} dropped the connection" in failure.message


async def test_an_answer_that_is_not_http_is_a_drop():
    async def garbage(reader, writer):
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await reader.read()

    async with _server(garbage) as (url, _):
        with pytest.raises(http1.ConnectionDropped, match="not HTTP"):
            await _call(_client(), url)


async def test_a_body_framed_by_the_connection_s_end_is_whole():
    async def unframed(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")

    async with _server(unframed) as (url, peers):
        client = _client()
        assert await _call(client, url) == (200, b"all of it")
        assert await _call(client, url) == (200, b"all of it")
        await client.close()
    assert len(peers) == 2  # not kept: the server closed it


async def test_calls_beyond_the_limit_wait_for_a_connection():
    release = asyncio.Event()

    async def gated(reader, writer):
        while True:
            await _read_request(reader)
            await release.wait()
            writer.write(_answer(b"{}"))

    async with _server(gated) as (url, peers):
        client = _client(limit_per_host=1)
        first = asyncio.ensure_future(_call(client, url))
        second = asyncio.ensure_future(_call(client, url))
        await asyncio.sleep(0.2)
        assert len(peers) == 1 and not first.done() and not second.done()
        release.set()
        assert await first == (200, b"{}") and await second == (200, b"{}")
        await client.close()
    assert len(peers) == 1


async def test_a_call_waiting_for_a_connection_times_out_at_its_deadline():
    async def never(reader, writer):
        await reader.read()

    async with _server(never) as (url, _):
        client = _client(limit_per_host=1)
        first = asyncio.ensure_future(_call(client, url, timeout_s=5))
        await asyncio.sleep(0.1)
        with pytest.raises(asyncio.TimeoutError):
            await _call(client, url, timeout_s=0.2)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await client.close()


async def test_a_cancelled_call_drops_its_connection():
    gone = asyncio.Event()

    async def silent(reader, writer):
        await _read_request(reader)
        await reader.read()
        gone.set()

    async with _server(silent) as (url, _):
        client = _client()
        call = asyncio.ensure_future(_call(client, url))
        await asyncio.sleep(0.1)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await asyncio.wait_for(gone.wait(), 5)  # vLLM would abort the request here


def test_a_header_with_a_line_break_is_refused():
    async def go():
        async with _server(_echo_forever) as (url, _):
            client = _client()
            with pytest.raises(ValueError, match="line break"):
                await client.request(
                    "POST", url, "/", headers={"X-Request-Id": "a\r\nX-Evil: 1"}, body=b"",
                    timeout_s=1,
                )  # fmt: skip

    asyncio.run(go())


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("http://127.0.0.1:8100", http1.Origin("127.0.0.1", 8100, "127.0.0.1:8100", False)),
        ("http://prefill", http1.Origin("prefill", 80, "prefill", False)),
        ("https://p.example:8443", http1.Origin("p.example", 8443, "p.example:8443", True)),
        ("https://p.example", http1.Origin("p.example", 443, "p.example", True)),
        ("http://[::1]:8200", http1.Origin("::1", 8200, "[::1]:8200", False)),
        ("http://[::1]", http1.Origin("::1", 80, "[::1]", False)),
    ],
)
def test_origin_of_a_backend_url(url, origin):
    assert http1.Origin.of(url) == origin


@pytest.mark.parametrize("trusted", [True, False])
async def test_an_https_backend_is_verified_against_the_default_trust(
    tmp_path, monkeypatch, trusted
):
    pki = make_pki(tmp_path / "pki")
    # The client's context is ssl.create_default_context(): OpenSSL reads SSL_CERT_FILE.
    monkeypatch.setenv(
        "SSL_CERT_FILE", str(pki.ca_cert if trusted else make_pki(tmp_path / "x").ca_cert)
    )
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki.server_cert, pki.server_key)
    server = await asyncio.start_server(_echo_forever, "127.0.0.1", 0, ssl=tls)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        client = _client()
        if trusted:
            assert await _call(client, url, b"abc") == (200, b'{"echo": 3}')
        else:
            with pytest.raises(http1.ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                await _call(client, url)
        await client.close()
