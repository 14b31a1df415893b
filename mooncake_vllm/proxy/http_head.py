"""Bounds on a client's request head, which uvicorn's httptools protocol reads without any.

uvicorn (0.54) keeps every header line a client sends until the blank line that ends the head,
however many and however long, and waits for that line as long as the connection is open: 191
MiB of headers grew the proxy by 200 MiB, and a connection that sends one byte a minute
(slowloris) is held forever. The head is read before the API key is checked, so anyone who can
connect could do it. ``BoundedHttpToolsProtocol`` is uvicorn's protocol with three bounds:

- ``MAX_HEAD_BYTES``: the request line and headers together; more gets 431 and the connection
  is closed (counted as the bytes arrive, so nothing past the bound is kept);
- ``MAX_HEADERS``: header lines in one head; more gets 431;
- ``HEAD_TIMEOUT_S``: from a connection's opening (or the first byte of its next request) to the
  end of the head; later gets 408 and the connection is closed.

The body has its own bounds in ``asgi.GenerationDoor`` (``--max-body-bytes``,
``--body-timeout-s``); uvicorn stops reading a body nobody reads beyond 64 KiB.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("mooncake_vllm.proxy")

# The request line and headers of one request: far above what OpenAI clients send (under 2 KiB),
# room for large bearer tokens and cookies.
MAX_HEAD_BYTES = 64 * 1024
# Header lines in one request head (Apache's LimitRequestFields).
MAX_HEADERS = 100
# A client has this long to send a whole head once its connection is open or its next request
# has begun (uvicorn's keep-alive timeout covers an idle connection between requests).
HEAD_TIMEOUT_S = 10.0

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _HeadRefused(Exception):
    """Raised in a parser callback: httptools stops and uvicorn answers (``send_400_response``)."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head bounded in size, lines and time."""

    max_head_bytes = MAX_HEAD_BYTES
    max_headers = MAX_HEADERS
    head_timeout_s = HEAD_TIMEOUT_S

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between requests or inside a head: the bounds apply
        self._head_bytes = 0
        self._head_lines = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Fed in pieces no longer than the room left in the head: a head past the bound is
        # refused before it is kept, and a body in the same read is not counted as head.
        while self._in_head and data and not self.transport.is_closing():
            room = self.max_head_bytes - self._head_bytes
            if room <= 0:
                self._refuse(431, f"request head is larger than {self.max_head_bytes} bytes")
                return
            self._arm_head_timer()
            piece, data = data[:room], data[room:]
            self._head_bytes += len(piece)
            super().data_received(piece)
        if data and not self.transport.is_closing():
            super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_lines = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_lines += 1
        if self._head_lines > self.max_headers:
            self._refusal = (431, f"more than {self.max_headers} header lines")
            raise _HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # the next request's head, once its first byte comes
        self._head_bytes = 0

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head httptools could not parse, or that a callback refused."""
        if self._refusal is None:
            super().send_400_response(msg)
            return
        status, reason = self._refusal
        self._refuse(status, reason)

    def _refuse(self, status: int, reason: str) -> None:
        self._disarm_head_timer()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.info("%s: %s; connection closed (%d)", client, reason, status)
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # no answer being sent
            body = reason.encode()
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status, _REASONS[status], len(body), body)
            )
        self.transport.close()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        timer, self._head_timer = self._head_timer, None
        if timer is not None:
            timer.cancel()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head:
            self._refuse(408, f"request head not complete within {self.head_timeout_s:g}s")
