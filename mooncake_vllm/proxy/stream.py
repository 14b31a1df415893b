"""Relaying a streamed decode answer to the client, and what happens when either side goes away.

The decode's SSE bytes are passed on unchanged as they arrive. A decode that fails mid-stream
(dropped connection, the request's deadline) ends the stream with one ``data: {"error": ...}``
event; a client that goes away closes the decode connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

import aiohttp

from mooncake_vllm.proxy import rewrite
from mooncake_vllm.proxy.errors import classify
from mooncake_vllm.proxy.failover import Backends, InFlight, RequestContext
from mooncake_vllm.proxy.legs import OpenDecode
from mooncake_vllm.proxy.limits import ClientSlot

logger = logging.getLogger("mooncake_vllm.proxy")


def _abandon(
    response: aiohttp.ClientResponse, in_flight: InFlight, client_slot: ClientSlot | None
) -> None:
    # close(), not release(): the connection must drop so vLLM notices and aborts the request.
    response.close()
    in_flight.release()
    if client_slot is not None:
        client_slot.release()


class DecodeStream:
    """The body of a streamed answer: the decode's SSE bytes, passed on as they arrive.

    Quart iterates it and calls ``aclose()`` when the response ends or the client disconnects
    (the handler task is cancelled). If the response is dropped before Quart starts iterating,
    the finalizer still closes the decode connection and releases the in-flight count. The
    client's slot under ``--client-*`` limits is the stream's too: the request ends with it.
    """

    def __init__(self, backends: Backends, leg: OpenDecode, ctx: RequestContext) -> None:
        self._backends = backends
        self._leg = leg
        self._ctx = ctx
        self._first_byte_seen = False
        self._at_event_boundary = True
        self._finished = False
        if ctx.client_slot is not None:
            ctx.client_slot.hand_over()  # the route returns now; the stream lasts longer
        self._close = weakref.finalize(self, _abandon, leg.response, leg.in_flight, ctx.client_slot)

    def __aiter__(self) -> DecodeStream:
        return self

    async def __anext__(self) -> bytes:
        if self._finished:
            raise StopAsyncIteration
        leg = self._leg
        try:
            chunk = await leg.response.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failure = classify(e, "decode", leg.backend.url, leg.deadline)
            if failure is None:
                raise
            self._backends.record_failure(leg.pool, leg.backend, failure)
            logger.warning("%s stream cut: %s", self._ctx.request_id, failure.message)
            self._finish(clean=False)
            # An event cut in its middle is closed first, so the client's SSE parser sees ours.
            separator = b"" if self._at_event_boundary else b"\n\n"
            return separator + rewrite.sse_error_event(failure.message, failure.kind.value)
        if not chunk:
            self._finish(clean=True)
            raise StopAsyncIteration
        if not self._first_byte_seen:
            self._first_byte_seen = True
            self._backends.metrics.first_decode_byte_seconds.observe(
                time.monotonic() - self._ctx.started_s
            )
        self._at_event_boundary = chunk.endswith(b"\n\n")
        return chunk

    def _finish(self, clean: bool) -> None:
        self._finished = True
        if clean:
            self._leg.response.release()  # fully read: the connection may be reused
        self._close()

    async def aclose(self) -> None:
        if not self._finished:
            logger.info(
                "%s client went away mid-stream; closing the decode stream", self._ctx.request_id
            )
            self._finished = True
        self._close()
