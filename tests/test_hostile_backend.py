"""A backend that misbehaves against the proxy's leg client (``mooncake_vllm.proxy.http1``):
servers on 127.0.0.1 written here send too many headers, a huge body, bytes after the answer,
a 103 before it, a reset mid-body, or close a kept-alive connection just as it is reused.

Each call either gets the backend's real answer or fails with a typed error that
``errors.classify`` reads as the backend's failure, and the proxy's memory does not grow by what
the backend sends (its peak RSS, reset before each call, against the size sent)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import time
from collections.abc import Iterator

import pytest
from test_proxy_http1 import Handler, _server  # a loopback server that records its peers

from mooncake_vllm.proxy import http1
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.errors import FailureKind, LegDeadline, classify
from mooncake_vllm.proxy.failover import Backends, RequestContext
from mooncake_vllm.proxy.metrics import ProxyMetrics

MiB = 1024 * 1024
HUGE_BYTES = 300 * MiB  # what the hostile servers offer to send


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    match = re.search(rb"(?i)content-length: *(\d+)", head)
    return await reader.readexactly(int(match.group(1)) if match else 0)


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset, not an orderly FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _send_until_closed(writer: asyncio.StreamWriter, piece: bytes, total: int) -> int:
    """Write ``piece`` over and over, up to ``total`` bytes or until the client goes; returns the
    bytes written."""
    sent = 0
    with contextlib.suppress(ConnectionError):
        while sent < total and not writer.is_closing():
            writer.write(piece)
            sent += len(piece)
            await writer.drain()
    return sent


def _client() -> http1.Client:
    return http1.Client(keepalive_s=4.0, connect_timeout_s=2.0, limit_per_host=10)


async def _call(client: http1.Client, url: str) -> tuple[int, bytes]:
    resp = await client.request("POST", url, "/v1/completions", headers={}, body=b"{}",
                                timeout_s=20)  # fmt: skip
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1))


@contextlib.contextmanager
def _peak_rss_growth() -> Iterator[list[int]]:
    """Yields a list that holds, once the block has run, how far the process's peak RSS rose
    above its RSS at the start (in bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak, to the RSS now
    start_kib = _status_kib("VmRSS")
    growth: list[int] = []
    yield growth
    growth.append((_status_kib("VmHWM") - start_kib) * 1024)


def _classified(error: BaseException, url: str) -> FailureKind:
    failure = classify(error, "decode", url, LegDeadline(20, 20, "--timeout-s"))
    assert failure is not None, "a backend's broken answer must be the backend's failure"
    assert url in failure.message
    return failure.kind


# ---- the head ----------------------------------------------------------------------------------


async def test_an_answer_with_300_001_headers_fails_after_the_hundredth_and_is_dropped():
    gone = asyncio.Event()

    async def many_headers(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"X-Filler: v\r\n" * 300_001 + b"\r\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            await reader.read()  # until the client closes
        gone.set()

    async with _server(many_headers) as (url, _):
        client = _client()
        with pytest.raises(http1.BadAnswer, match="over 100 headers") as caught:
            await _call(client, url)
        await asyncio.wait_for(gone.wait(), 10)  # the connection was closed, not kept
        await client.close()
    assert _classified(caught.value, url) is FailureKind.PROTOCOL


@pytest.mark.parametrize(
    ("start", "piece"),
    [
        # One header line that never ends.
        (b"HTTP/1.1 200 OK\r\nX-Long: ", b"v" * (64 * 1024)),
        # 103 Early Hints, one after another, never the final answer.
        (b"", b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n" * 1000),
    ],
    ids=["one-endless-header", "endless-103s"],
)
async def test_a_head_past_64_kib_fails_and_only_that_much_is_read(start, piece):
    async def endless_head(reader, writer):
        await _read_request(reader)
        writer.write(start)
        await _send_until_closed(writer, piece, 16 * MiB)
        writer.write(b"\r\n\r\n")  # ended, for a client that took it all

    async with _server(endless_head) as (url, _):
        client = _client()
        with (
            _peak_rss_growth() as growth,
            pytest.raises(http1.BadAnswer, match="head is over 65536 bytes") as caught,
        ):
            await _call(client, url)
        await client.close()
    assert _classified(caught.value, url) is FailureKind.PROTOCOL
    assert growth[0] < 8 * MiB


async def test_100_and_103_are_skipped_and_the_final_answer_read():
    async def hints_first(reader, writer):
        while True:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
            writer.write(_answer(b'{"ok": true}'))

    async with _server(hints_first) as (url, peers):
        client = _client()
        for _ in range(2):
            resp = await client.request("GET", url, "/v1/models", headers={}, timeout_s=5)
            assert (resp.status, await resp.read()) == (200, b'{"ok": true}')
            assert "link" not in resp.headers  # the hint's headers are not the answer's
            resp.release()
        await client.close()
    assert len(peers) == 1  # the answer was read whole: the connection was kept


async def test_a_switch_of_protocols_nobody_asked_for_is_a_broken_answer():
    async def switch(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n")
        writer.write(b"Upgrade: websocket\r\n\r\nraw bytes")
        await reader.read()

    async with _server(switch) as (url, _):
        client = _client()
        with pytest.raises(http1.BadAnswer, match="switched protocols"):
            await _call(client, url)
        await client.close()


# ---- the body ----------------------------------------------------------------------------------


async def test_a_body_declared_at_300_mib_fails_before_it_is_buffered():
    async def declared(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % HUGE_BYTES)
        await _send_until_closed(writer, bytes(MiB), HUGE_BYTES)

    async with _server(declared) as (url, _):
        client = _client()
        with (
            _peak_rss_growth() as growth,
            pytest.raises(http1.BadAnswer, match="over 67108864 bytes") as caught,
        ):
            await _call(client, url)
        await client.close()
    assert _classified(caught.value, url) is FailureKind.PROTOCOL
    assert growth[0] < 32 * MiB


async def test_a_chunked_body_of_300_mib_fails_at_the_bound_and_is_not_kept():
    sent: list[int] = []
    done = asyncio.Event()

    async def chunked(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (MiB, bytes(MiB))
        sent.append(await _send_until_closed(writer, chunk, HUGE_BYTES))
        done.set()

    async with _server(chunked) as (url, _):
        client = _client()
        with _peak_rss_growth() as growth:
            with pytest.raises(http1.BadAnswer, match="over 67108864 bytes"):
                await _call(client, url)
            await client.close()
            await asyncio.wait_for(done.wait(), 20)  # the server saw the client go
    assert sent[0] < 128 * MiB  # it stopped reading at 64 MiB, not at 300
    # At most the bound's buffer (and its growth), not the 300 MiB sent.
    assert growth[0] < 100 * MiB


async def test_a_stream_of_tiny_chunks_is_paused_after_a_bounded_buffer():
    async def tiny_chunks(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await _send_until_closed(writer, b"1\r\nx\r\n" * 10_000, 48 * MiB)  # 8M chunks

    async with _server(tiny_chunks) as (url, _):
        client = _client()
        with _peak_rss_growth() as growth:
            resp = await client.request("GET", url, "/s", headers={}, timeout_s=30)
            transport = resp._conn.transport
            deadline = time.monotonic() + 20
            while transport.is_reading() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # reading pauses once the unread buffer is full
            assert not transport.is_reading()
            first = await resp.read_some()
        resp.close()
        await client.close()
    assert 0 < len(first) <= 4 * MiB
    # 8 M tiny bytes objects would be ~340 MiB; the buffer counts each chunk's overhead.
    assert growth[0] < 48 * MiB


async def test_trailing_bytes_after_an_answer_do_not_join_it_and_drop_the_connection():
    trailers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil",  # a whole second answer
        b"HTTP/1.1 500 Smuggled\r\nX-Smuggled: 1\r\n",  # the start of one, for the next call
        b"garbage",
    ]

    async def trailing(reader, writer):
        connection = len(peers)
        await _read_request(reader)
        if connection <= len(trailers):  # one trailer per connection, then plain answers
            writer.write(_answer(b"hello") + trailers[connection - 1])
        else:
            writer.write(_answer(b"next"))
        while True:  # what a later call on this connection gets
            await _read_request(reader)
            writer.write(_answer(b"next"))

    async with _server(trailing) as (url, peers):
        client = _client()
        for _ in trailers:
            assert await _call(client, url) == (200, b"hello")
        assert await _call(client, url) == (200, b"next")
        await client.close()
    assert len(peers) == len(trailers) + 1  # none kept for another call


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\n\r\n",  # framed by the connection's end
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\n",
    ],
    ids=["unframed", "content-length", "chunked"],
)
async def test_a_reset_mid_body_is_a_drop_not_a_complete_body(head):
    async def cut(reader, writer):
        await _read_request(reader)
        writer.write(head + b"partial")
        await writer.drain()
        await asyncio.sleep(0.05)  # let the bytes go before the reset
        _reset(writer)

    async with _server(cut) as (url, _):
        client = _client()
        with pytest.raises(http1.ConnectionDropped) as caught:
            await _call(client, url)
        await client.close()
    assert not isinstance(caught.value, http1.BadAnswer)
    assert _classified(caught.value, url) is FailureKind.DISCONNECT


# ---- a kept-alive connection closed as it is reused -------------------------------------------


def _closes_on_second_request(*, reset: bool) -> Handler:
    """The first connection answers its first request and closes, unanswered, as the second
    arrives (a keep-alive timer that fired as the proxy reused it); later connections answer."""
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        if connections == 1:
            await _read_request(reader)
            writer.write(_answer(b"first"))
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
            if reset:
                _reset(writer)
            return  # closed (FIN) with the request unanswered
        while True:
            await _read_request(reader)
            writer.write(_answer(b"fresh"))

    return handler


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "reset"])
async def test_a_reused_connection_closed_unanswered_is_retried_on_a_new_one(reset):
    async with _server(_closes_on_second_request(reset=reset)) as (url, peers):
        client = _client()
        assert await _call(client, url) == (200, b"first")
        assert await _call(client, url) == (200, b"fresh")
        await client.close()
    assert len(peers) == 2


async def test_the_retry_neither_ejects_the_backend_nor_counts_a_failure():
    async with _server(_closes_on_second_request(reset=False)) as (url, peers):
        backends = Backends(ProxyConfig(prefill=[url], decode=[url]), ProxyMetrics())
        await backends.open()
        ctx = RequestContext("r", time.monotonic(), "/v1/models", {}, {})
        for expected in (b"first", b"fresh", b"fresh"):
            attempt = await backends.read_whole("decode", ctx, "GET")
            assert attempt.answer.body == expected
        await backends.close()
    [decode] = backends.pools["decode"].backends
    assert decode.healthy
    failures = [
        sample
        for metric in backends.metrics.registry.collect()
        if metric.name == "mooncake_proxy_backend_errors"
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.value
    ]
    assert failures == []
    assert len(peers) == 2


async def test_a_fresh_connection_closed_unanswered_is_not_retried():
    async def drops_every_request(reader, writer):
        await reader.readuntil(b"\r\n\r\n")

    async with _server(drops_every_request) as (url, peers):
        client = _client()
        with pytest.raises(http1.ConnectionDropped) as caught:
            await _call(client, url)
        await client.close()
    assert _classified(caught.value, url) is FailureKind.DISCONNECT
    assert len(peers) == 1


async def test_a_reused_connection_is_retried_once_only():
    connections = 0

    async def answers_only_the_first(reader, writer):
        nonlocal connections
        connections += 1
        if connections == 1:
            await _read_request(reader)
            writer.write(_answer(b"first"))
            await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # then closed unanswered

    async with _server(answers_only_the_first) as (url, peers):
        client = _client()
        assert await _call(client, url) == (200, b"first")
        with pytest.raises(http1.ConnectionDropped) as caught:
            await _call(client, url)
        await client.close()
    assert _classified(caught.value, url) is FailureKind.DISCONNECT
    assert len(peers) == 2
