"""The proxy's HTTP/1.1 client for its legs: keep-alive connections per backend, answers parsed
by httptools (llhttp, the parser uvicorn serves the proxy's own requests with).

Every generation request makes two backend calls, so the client's cost per call is paid twice
on the proxy's hot path. aiohttp's ``ClientSession`` took 400–490 µs of CPU per call on the
benchmark host (a request object, a payload registry, a writer, a cookie jar, timers and traces
per call) against 70–90 µs for a request written in one ``write`` and parsed by httptools
(docs/benchmarks.md, "Proxy cost"). What the legs need of a client is small, and all of it is
here:

- keep-alive connections per backend, the most recently used first; one idle longer than
  ``keepalive_s`` is closed, never reused (vLLM's uvicorn drops idle connections after 5 s, and a
  request sent on a connection the server is closing would look like a dead backend);
- at most ``limit_per_host`` connections per backend; more calls wait for one;
- one deadline per call, from its start to the answer's last byte (aiohttp's ``total``), and a
  shorter one for opening the connection;
- the answer's head (status, headers) before its body, which is then read whole or as it
  arrives (a stream), with reading paused while the reader lags;
- ``close()`` drops the connection (vLLM aborts a request whose client went away);
  ``release()`` keeps a fully read one for the next call;
- failures as two exceptions that say whether the backend can have seen the request
  (``ConnectFailed``: no) or not known (``ConnectionDropped``, and ``BadAnswer`` when what came
  back broke HTTP/1.1 or a bound below), and ``asyncio.TimeoutError``;
- a request sent on a kept-alive connection that the server closed before answering a byte is
  sent once more on a new connection: the server's keep-alive timer and our reuse crossed, and
  it closed without reading the request (a fresh connection's failure is the caller's).

A backend's answer is read strictly and within bounds, so a broken or hostile backend costs the
proxy one call, never its memory: at most ``MAX_HEADER_COUNT`` headers and ``MAX_HEAD_BYTES``
of status line and headers (1xx heads included, which are skipped), at most
``max_body_bytes`` of a body read whole (``read``), a stream's unread bytes under a high-water
mark; a byte after the answer's end, a 101, or a body the connection's reset cut short is an
error and the connection is closed, never reused.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

logger = logging.getLogger("mooncake_vllm.proxy")

# Bounds on an answer's head, as servers bound a request's (Apache: 100 header fields; Node:
# 16 KiB of head). vLLM's answers carry under 10 headers.
MAX_HEADER_COUNT = 100
MAX_HEAD_BYTES = 64 * 1024  # the status lines and headers of the final answer and any 1xx
# A body read whole (``Response.read``), far above a vLLM JSON answer; a stream is not bounded
# in length, only in what is buffered of it (the marks below).
MAX_BODY_BYTES = 64 * 1024 * 1024
# Reading a streamed answer pauses above this many unread bytes and resumes below the low mark.
_HIGH_WATER_BYTES = 4 * 1024 * 1024
_LOW_WATER_BYTES = 1024 * 1024
# What a buffered chunk costs beyond its bytes, counted against the marks: a stream of tiny
# chunks pauses as soon as one of big chunks, not after millions of objects.
_CHUNK_OVERHEAD_BYTES = 64


class BackendIOError(Exception):
    """A backend call that failed below HTTP."""


class ConnectFailed(BackendIOError):
    """No connection could be opened: the backend never saw the request."""


class ConnectionDropped(BackendIOError):
    """The connection closed or broke once the request may have been sent, the answer's body
    unfinished (its Content-Length not reached, its last chunk not come)."""


class BadAnswer(ConnectionDropped):
    """What the backend sent is not an HTTP/1.1 answer to the request, or passes one of the
    bounds (``MAX_HEADER_COUNT``, ``MAX_HEAD_BYTES``, ``max_body_bytes``); the connection is
    closed. The backend may have acted on the request."""


@dataclass(frozen=True)
class Origin:
    """Where a backend URL (``config.normalize_backend_url``) connects, and its Host header."""

    host: str
    port: int
    netloc: str
    tls: bool

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s)://HOST[:PORT] URL")
        tls = parts.scheme == "https"
        port = parts.port if parts.port is not None else (443 if tls else 80)
        return cls(parts.hostname, port, parts.netloc, tls)


def _ends_at_close(response: Response) -> bool:
    headers = response.headers
    return (
        "content-length" not in headers
        and "transfer-encoding" not in headers
        and response.status not in (204, 304)
    )


def _header_bytes(text: str) -> bytes:
    if "\r" in text or "\n" in text:
        raise ValueError(f"a header holds a line break: {text!r}")
    try:
        return text.encode("latin-1")  # what uvicorn decoded the client's header bytes with
    except UnicodeEncodeError:
        return text.encode()


class Response:
    """A backend's answer: its head is read, its body is read with ``read`` or ``read_some``.

    The caller must end it with ``release()`` or ``close()`` (both idempotent)."""

    def __init__(
        self, conn: _Connection, status: int, headers: dict[str, str], max_body_bytes: int
    ) -> None:
        self.status = status
        self.headers = headers  # names in lower case
        self._conn = conn
        self._max_body_bytes = max_body_bytes
        self._chunks: collections.deque[bytes] = collections.deque()
        self._unread = 0
        self._whole: bytearray | None = None  # the body so far, while read() waits for it
        self._complete = False  # the whole body has arrived
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._body: bytes | None = None  # what read() returned, for a second read()
        self._ended = False  # released or closed

    @property
    def content_type(self) -> str:
        """The media type without parameters (``application/json``), as aiohttp gives it."""
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    # ---- fed by the connection ------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        """Raises BadAnswer past ``max_body_bytes`` of a body read whole (the parser stops)."""
        whole = self._whole
        if whole is not None:  # read() takes all of it: one buffer, not a chunk per piece
            whole += data
            if len(whole) > self._max_body_bytes:
                raise self._too_large()
        else:
            self._chunks.append(data)
            self._unread += len(data)
            if self._buffered_bytes() > _HIGH_WATER_BYTES:
                self._conn.pause_reading()
        self._wake()

    def _buffered_bytes(self) -> int:
        return self._unread + len(self._chunks) * _CHUNK_OVERHEAD_BYTES

    def _too_large(self) -> BadAnswer:
        return BadAnswer(
            f"the answer's body is over {self._max_body_bytes} bytes, the most read whole"
            " (http1.MAX_BODY_BYTES)"
        )

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._complete and self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # ---- read by the caller ---------------------------------------------------------------------

    async def read(self) -> bytes:
        """The whole body (kept: a second call returns it again); raises BadAnswer, and closes
        the connection, when it is over ``max_body_bytes``."""
        if self._body is not None:
            return self._body
        whole = self._whole
        if whole is None:
            whole = bytearray().join(self._chunks)
            self._chunks.clear()
            self._unread = 0
            declared = self.headers.get("content-length")  # digits only: llhttp checked it
            if len(whole) > self._max_body_bytes or (
                declared is not None and int(declared) > self._max_body_bytes
            ):
                self._error = self._too_large()
                self._conn.abort()  # nothing more of it is wanted, nor the connection
                raise self._error
            self._whole = whole
        while not self._complete:
            if self._error is not None:
                raise self._error
            self._conn.resume_reading()  # all of it is wanted
            await self._wait()
        self._body = bytes(whole)
        self._whole = None
        return self._body

    async def read_some(self, limit: int | None = None) -> bytes:
        """The body's next bytes as they arrive (at most ``limit``); b"" at its end."""
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        if len(self._chunks) == 1:
            data = self._chunks.popleft()
        else:
            data = b"".join(self._chunks)
            self._chunks.clear()
        if limit is not None and len(data) > limit:
            data, rest = data[:limit], data[limit:]
            self._chunks.appendleft(rest)
        self._unread -= len(data)
        if self._buffered_bytes() < _LOW_WATER_BYTES:
            self._conn.resume_reading()
        return data

    @property
    def ended(self) -> bool:
        """``release()`` or ``close()`` has been called."""
        return self._ended

    @property
    def fully_read(self) -> bool:
        return self._complete and not self._chunks

    def release(self) -> None:
        """Done with the answer: a fully read connection is kept for reuse, any other closed."""
        if self._ended:
            return
        self._ended = True
        self._conn.end_call(reuse=self.fully_read and self._error is None)

    def close(self) -> None:
        """Drop the connection, read or not (the backend sees its client go)."""
        if self._ended:
            return
        self._ended = True
        self._conn.end_call(reuse=False)


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one call at a time.

    The parser's callbacks raise BadAnswer for what breaks the answer's framing or a bound;
    ``data_received`` fails the call with it and closes the connection."""

    def __init__(self, client: Client, origin: Origin) -> None:
        self.client = client
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._headers: dict[str, str] = {}
        self._head: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._keep_alive = False
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self.counted = False  # holds one of its origin's connection slots (``Client._open``)
        # This call's answer so far: a byte came; the head's bytes (1xx heads too) and this
        # head's header count; the final answer has ended.
        self.answer_started = False
        self._head_bytes = 0
        self._header_count = 0
        self._informational = False  # the head being parsed is a 1xx
        self._answered = False

    # ---- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._head is None and self._response is None:
            self.abort()  # bytes nobody asked for: the connection is not ours to trust
            return
        self.answer_started = True
        try:
            if self._head is not None:  # the head is awaited: only so many bytes may make it
                room = MAX_HEAD_BYTES - self._head_bytes
                if len(data) > room:
                    view = memoryview(data)
                    self._parser.feed_data(view[:room])
                    self._head_bytes = MAX_HEAD_BYTES
                    if self._head is not None:
                        raise BadAnswer(
                            f"the answer's head is over {MAX_HEAD_BYTES} bytes"
                            " (http1.MAX_HEAD_BYTES)"
                        )
                    data = view[room:]  # type: ignore[assignment]  # feed_data takes either
                else:
                    self._head_bytes += len(data)
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            self._fail(cause if isinstance(cause, BadAnswer) else BadAnswer(str(e)))
            self.abort()
        except httptools.HttpParserUpgrade:
            self._fail(BadAnswer("the backend switched protocols, which no call asks for"))
            self.abort()
        except httptools.HttpParserError as e:
            self._fail(BadAnswer(f"the answer is not HTTP/1.1: {e}"))
            self.abort()
        except BadAnswer as e:
            self._fail(e)
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        response = self._response
        if response is not None and exc is None and _ends_at_close(response):
            # A body framed by the connection's end (neither length nor chunks) ends with an
            # orderly close; a reset cut it short.
            response._finish()
        self._fail(ConnectionDropped(f"connection lost: {exc}" if exc else "connection closed"))
        self.client._lost(self)

    # ---- httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._answered:
            # A second answer, or bytes the first one's framing did not cover: left to the next
            # call, they would become its answer.
            raise BadAnswer("bytes after the end of the answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > MAX_HEADER_COUNT:
            raise BadAnswer(
                f"the answer has over {MAX_HEADER_COUNT} headers (http1.MAX_HEADER_COUNT)"
            )
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        headers, self._headers = self._headers, {}
        self._header_count = 0
        if status == 101:
            raise BadAnswer("the backend switched protocols, which no call asks for")
        self._informational = 100 <= status < 200
        if self._informational:
            return  # 100 Continue, 103 Early Hints: the final answer follows
        head, self._head = self._head, None
        if head is None or head.done():  # an answer nobody waits for (a late one)
            raise BadAnswer("an answer no call waits for")
        response = Response(self, status, headers, self.client.max_body_bytes)
        self._response = response
        head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self._response is None:
            raise BadAnswer("an informational (1xx) answer with a body")
        self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self._answered = True
        self._keep_alive = self._parser.should_keep_alive()
        self._cancel_timer()
        if self._response is not None:
            self._response._finish()

    # ---- one call -------------------------------------------------------------------------------

    @property
    def open(self) -> bool:
        """Neither closed nor closing (``abort`` was called; ``connection_lost`` will be)."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def send(self, request: bytes, deadline: float) -> asyncio.Future[Response]:
        if not self.open:
            raise ConnectFailed("the connection closed before the request was sent")
        self._head = self.loop.create_future()
        self._response = None
        self._keep_alive = False
        self.answer_started = False
        self._head_bytes = 0
        self._answered = False
        self._timer = self.loop.call_at(deadline, self._time_out)
        self.transport.write(request)
        return self._head

    def _time_out(self) -> None:
        self._timer = None
        self._fail(asyncio.TimeoutError())
        self.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, error: BaseException) -> None:
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(error)
        if self._response is not None:
            self._response._fail(error)

    def end_call(self, *, reuse: bool) -> None:
        self._cancel_timer()
        self._response = None
        if reuse and self._keep_alive and self.open:
            self.resume_reading()
            self.client._keep(self)
        else:
            self.abort()

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()


class Client:
    """Calls to backends over keep-alive connections (see the module's text)."""

    def __init__(
        self,
        *,
        keepalive_s: float,
        connect_timeout_s: float,
        limit_per_host: int,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.limit_per_host = limit_per_host
        self.max_body_bytes = max_body_bytes
        self._origins: dict[str, Origin] = {}
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: collections.Counter[Origin] = collections.Counter()
        self._slot_waiters: dict[Origin, collections.deque[asyncio.Future[None]]] = {}
        self._tls: ssl.SSLContext | None = None
        self._connections: set[_Connection] = set()  # every open one, idle or in use
        self._closed = False

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None = None,
        timeout_s: float,
    ) -> Response:
        """Send one call and return its answer once its head has arrived; the body is the
        caller's to read and the answer its to ``release()`` or ``close()``."""
        if self._closed:
            raise RuntimeError("the backend client is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = Origin.of(base_url)
        lines = [f"{method} {path} HTTP/1.1\r\nHost: {origin.netloc}\r\n".encode()]
        lines += [_header_bytes(f"{k}: {v}") + b"\r\n" for k, v in headers.items()]
        if body is not None:
            lines.append(b"Content-Length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        if body:
            lines.append(body)
        request = b"".join(lines)
        conn, reused = await self._acquire(origin, deadline, reuse=True)
        try:
            return await self._send(conn, request, deadline)
        except (ConnectFailed, ConnectionDropped) as e:
            if not reused or conn.answer_started:
                raise
            first = e
        # The server closed the kept-alive connection as the request went out (its keep-alive
        # timer and our reuse crossed): not a byte of an answer came. Once more, on a new one.
        logger.debug("%s: a kept-alive connection closed unanswered (%s); resent", origin, first)
        try:
            conn, _ = await self._acquire(origin, deadline, reuse=False)
            return await self._send(conn, request, deadline)
        except ConnectFailed as e:
            if isinstance(first, ConnectionDropped):
                # The first send may have reached a backend that is now gone: say so.
                raise first from e
            raise

    async def _send(self, conn: _Connection, request: bytes, deadline: float) -> Response:
        try:
            return await conn.send(request, deadline)
        except BaseException:
            conn.abort()  # cancelled, timed out or broken: the connection is not reused
            raise

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._connections):
            conn.abort()
        self._idle.clear()

    # ---- the pool -------------------------------------------------------------------------------

    async def _acquire(
        self, origin: Origin, deadline: float, *, reuse: bool
    ) -> tuple[_Connection, bool]:
        """A connection to ``origin``, and whether it was kept from an earlier call; a new one
        unless ``reuse``."""
        loop = asyncio.get_running_loop()
        while True:
            idle = self._idle.get(origin)
            while idle and reuse:
                conn = idle.pop()
                if not conn.open:
                    continue
                if loop.time() - conn.idle_since > self.keepalive_s:
                    conn.abort()
                    continue
                return conn, True
            if self._open[origin] < self.limit_per_host:
                break
            await self._wait_for_slot(origin, deadline)
        self._open[origin] += 1
        try:
            return await self._connect(origin, deadline), False
        except BaseException:
            self._open[origin] -= 1
            self._wake_slot_waiter(origin)
            raise

    async def _connect(self, origin: Origin, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        left_s = deadline - loop.time()
        if left_s <= 0:
            raise asyncio.TimeoutError()
        tls = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        conn = _Connection(self, origin)
        try:
            async with asyncio.timeout(min(left_s, self.connect_timeout_s)):
                transport, _ = await loop.create_connection(
                    lambda: conn,
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except BaseException as e:
            conn.abort()  # cancelled as it connected: the caller gives its slot back
            if isinstance(e, TimeoutError):
                if left_s <= self.connect_timeout_s:
                    raise  # the call's own deadline passed
                raise ConnectFailed(
                    f"no connection after {self.connect_timeout_s:g}s (--connect-timeout-s)"
                ) from e
            if isinstance(e, OSError):
                raise ConnectFailed(str(e) or type(e).__name__) from e
            raise
        # uvloop may call connection_made after create_connection has returned.
        conn.transport = transport  # type: ignore[assignment]
        conn.counted = True
        self._connections.add(conn)
        return conn

    async def _wait_for_slot(self, origin: Origin, deadline: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._slot_waiters.setdefault(origin, collections.deque())
        waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        finally:
            if waiter in waiters:
                waiters.remove(waiter)

    def _wake_slot_waiter(self, origin: Origin) -> None:
        waiters = self._slot_waiters.get(origin)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _keep(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        now = conn.loop.time()
        conn.idle_since = now
        idle = self._idle.setdefault(conn.origin, [])
        # Close the oldest idle connections as they expire, so a quiet backend keeps none.
        while idle and (idle[0].closed or now - idle[0].idle_since > self.keepalive_s):
            idle.pop(0).abort()
        idle.append(conn)
        self._wake_slot_waiter(conn.origin)

    def _lost(self, conn: _Connection) -> None:
        self._connections.discard(conn)
        if not conn.counted:
            return  # never handed out: _acquire gave its slot back
        conn.counted = False
        self._open[conn.origin] -= 1
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)
        self._wake_slot_waiter(conn.origin)
