"""The generation endpoints as a plain ASGI handler in front of the Quart app.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are the proxy's hot path: every other
route (``/health``, ``/metrics``, ``/v1/models``, anything unknown) goes on to Quart. Quart's
per-request machinery (request and app contexts, ``g``, URL matching, werkzeug headers, hooks,
a response object, a task per request) cost more than the rest of the proxy's own work together
(a py-spy profile under ``benchmarks.proxy``, docs/benchmarks.md "Proxy cost"), so these two
paths skip it and keep what it gave them, in one place each:

- the per-request gate (API key, ``--client-*`` limits, ``X-Request-Id``): ``app.Gate``, which
  Quart's ``before_request`` uses for the other routes;
- the request body limit (``--max-body-bytes``: 413) and its read deadline
  (``--body-timeout-s``: 408); a client that leaves before its body is whole is logged at INFO
  and counted with status 499 (nginx's "client closed request"), not as a failure;
- OpenAI-shaped error bodies for every failure, ``X-Request-Id`` on every answer, and the
  ``mooncake_proxy_requests_total`` count;
- a client that goes away cancels the request (the decode connection is closed, so vLLM aborts
  it), mid-stream included: ``http.disconnect`` is watched while the answer is made and sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from werkzeug.exceptions import (
    HTTPException,
    MethodNotAllowed,
    RequestEntityTooLarge,
)

from mooncake_vllm.core import tracing
from mooncake_vllm.proxy import rewrite
from mooncake_vllm.proxy.errors import ProxyError

logger = logging.getLogger("mooncake_vllm.proxy")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATION_PATHS = frozenset({rewrite.COMPLETIONS_PATH, rewrite.CHAT_COMPLETIONS_PATH})

_JSON = b"application/json"
# What ``mooncake_proxy_requests_total`` counts a request under whose client left before its
# body was whole: nothing was answered (nginx's "client closed request").
CLIENT_LEFT_STATUS = 499


class Stream(Protocol):
    """A streamed answer's body (``stream.DecodeStream``, ``stream.MergedStream``)."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass
class Answer:
    """What the client gets: a whole body, or a stream of server-sent events."""

    status: int
    body: bytes | Stream
    content_type: bytes = _JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @classmethod
    def json(
        cls, status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> Answer:
        return cls(status, rewrite.encode_json(body), headers=headers)

    @classmethod
    def event_stream(cls, status: int, stream: Stream) -> Answer:
        return cls(status, stream, b"text/event-stream")


@dataclass
class Incoming:
    """The parts of a client request the generation handler reads (ASGI header names are
    lowercase bytes)."""

    path: str
    body: bytes
    authorization: str | None
    request_id_header: str | None
    remote_addr: str | None
    # The trace context the legs go out under: the client's ``traceparent``/``tracestate``
    # with tracing off, the proxy's request span with it on ({}: none).
    trace_parent: dict[str, str] = field(default_factory=dict)


@dataclass
class Admitted:
    """A request past the gate; ``refusal``: the answer it gets instead of being served (401,
    429). ``request_id`` may still change (``app.generation``: the body's ``request_id``); the
    answer carries the final one."""

    request_id: str
    started_s: float  # time.monotonic() at arrival; --timeout-s counts from here
    refusal: Answer | None = None
    # The client's slot under --client-* limits; a streamed answer takes it over.
    client_slot: Any = None


class Gate(Protocol):
    def admit(
        self, path: str, authorization: str | None, request_id: str | None, remote_addr: str | None
    ) -> Admitted: ...

    def count(self, endpoint: str, status: int) -> None: ...


Handler = Callable[[Incoming, Admitted], Awaitable[Answer]]


def http_error_answer(e: HTTPException, max_body_bytes: int) -> Answer:
    """The OpenAI error body for a werkzeug HTTP error (Quart's and the front door's alike)."""
    status = e.code or 500
    if status == 413:
        message = f"request body is larger than {max_body_bytes} bytes (--max-body-bytes)"
    else:
        message = f"{e.name}: {e.description}" if e.description else e.name
    error_type = "invalid_request_error" if status < 500 else "internal_error"
    return Answer.json(status, rewrite.openai_error(message, error_type))


class _ClientLeft(Exception):
    pass


class _BodyError(Exception):
    def __init__(self, answer: Answer) -> None:
        self.answer = answer


class GenerationDoor:
    """The ASGI app: the generation paths served by ``handler``, everything else by ``app``."""

    def __init__(
        self,
        app: AsgiApp,
        gate: Gate,
        handler: Handler,
        *,
        max_body_bytes: int,
        body_timeout_s: float,
        tracer: Any = None,
    ) -> None:
        self._tracer = tracer  # core.tracing's, or None: no spans
        self._app = app
        self._gate = gate
        self._handler = handler
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self._app(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        # Set when the client went away and the watcher cancelled this task; None until the
        # request body is read (the watcher reads ``receive`` from then on).
        gone = _ClientGone()
        try:
            await self._serve(scope, receive, send, task, gone)
        except asyncio.CancelledError:
            if not gone.cancelled_us:
                raise
            task.uncancel()  # the cancellation was ours: the request ends quietly
        finally:
            gone.stop()

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, task: asyncio.Task, gone: _ClientGone
    ) -> None:
        path = scope["path"]
        authorization = request_id_header = content_length = None
        trace_parent: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-request-id":
                request_id_header = value.decode("latin-1")
            elif name == b"content-length":
                content_length = value
            elif name in tracing.TRACE_HEADER_BYTES and len(value) <= tracing.MAX_TRACE_HEADER:
                trace_parent[name.decode()] = value.decode("latin-1")
        client = scope.get("client")
        admitted = self._gate.admit(
            path, authorization, request_id_header, client[0] if client else None
        )
        if admitted.refusal is not None:
            await self._send(send, admitted.refusal, admitted, path)
            return
        span = None  # the request's span (tracing on)
        try:
            if scope["method"] != "POST":
                raise _BodyError(
                    http_error_answer(MethodNotAllowed(["POST"]), self._max_body_bytes)
                )
            body = await self._read_body(receive, content_length)
            gone.watch(receive, task)
            incoming = Incoming(path, body, authorization, request_id_header, client and client[0])
            if self._tracer is not None:
                span = tracing.start(self._tracer, "proxy.request", trace_parent, "SERVER",
                                     {"http.route": path})  # fmt: skip
                incoming.trace_parent = tracing.headers_of(span)
            else:
                incoming.trace_parent = trace_parent
            answer = await self._handler(incoming, admitted)
        except _BodyError as e:
            answer = e.answer
        except asyncio.CancelledError:
            tracing.end(span, "the client went away")
            raise
        except _ClientLeft:
            logger.info(
                "%s: the client left before its request body was whole", admitted.request_id
            )
            self._gate.count(path, CLIENT_LEFT_STATUS)
            return
        except ProxyError as e:
            logger.info("%s -> %d: %s", admitted.request_id, e.status, e)
            answer = Answer.json(e.status, e.body)
        except Exception as e:
            logger.exception("%s failed", admitted.request_id)
            message = f"internal proxy error: {type(e).__name__}"
            answer = Answer.json(500, rewrite.openai_error(message, "internal_error"))
        finally:
            # A streamed answer has taken the slot over by now; it ends with the stream.
            if admitted.client_slot is not None:
                admitted.client_slot.release_unless_handed_over()
        try:
            await self._send(send, answer, admitted, path)
        finally:
            if span is not None:
                error = f"HTTP {answer.status}" if answer.status >= 400 else None
                labels = {
                    "http.status_code": answer.status,
                    "mooncake.request_id": admitted.request_id,
                }
                tracing.end(span, error, **labels)
        gone.stop()

    async def _read_body(self, receive: Receive, content_length: bytes | None) -> bytes:
        """The whole request body, at most ``--max-body-bytes`` (413) within
        ``--body-timeout-s`` (408): every wait for it counts, the first included, so a client
        that sends a head and then nothing is answered and its ``--client-*`` slot freed."""
        limit = self._max_body_bytes
        if content_length is not None and content_length.isdigit() and int(content_length) > limit:
            raise _BodyError(http_error_answer(RequestEntityTooLarge(), limit))
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self._body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        raise _ClientLeft  # http.disconnect: nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _BodyError(http_error_answer(RequestEntityTooLarge(), limit))
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            message = f"the request body did not arrive within {self._body_timeout_s:g}s"
            answer = Answer.json(408, rewrite.openai_error(f"{message} (--body-timeout-s)"))
            raise _BodyError(answer) from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _send(self, send: Send, answer: Answer, admitted: Admitted, path: str) -> None:
        headers = [
            (b"content-type", answer.content_type),
            (b"x-request-id", admitted.request_id.encode()),
            *answer.headers,
        ]
        self._gate.count(path, answer.status)
        body = answer.body
        if isinstance(body, bytes):
            headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        headers.append((b"cache-control", b"no-cache"))
        try:
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await body.aclose()  # the client went away: closes the decode connection
        await send({"type": "http.response.body", "body": b""})


class _ClientGone:
    """Watches ``receive`` for ``http.disconnect`` once the body is read, and cancels the
    request's task when it comes: what Quart does for its requests."""

    def __init__(self) -> None:
        self.cancelled_us = False
        self._watcher: asyncio.Task | None = None

    def watch(self, receive: Receive, task: asyncio.Task) -> None:
        async def wait_for_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if self._watcher is not None:  # not stopped meanwhile
                self.cancelled_us = True
                task.cancel()

        self._watcher = asyncio.ensure_future(wait_for_disconnect())

    def stop(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
