"""Relaying a streamed decode answer to the client, and what happens when either side goes away.

The decode's SSE bytes are passed on unchanged as they arrive (``DecodeStream``); the streams of
a list of prompts are merged into one (``MergedStream``). A decode that fails mid-stream
(dropped connection, the request's deadline) ends the stream with one ``data: {"error": ...}``
event; a client that goes away closes the decode connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

from mooncake_vllm.proxy import http1, rewrite
from mooncake_vllm.proxy.errors import BackendFailure, classify
from mooncake_vllm.proxy.failover import Backends, InFlight, RequestContext
from mooncake_vllm.proxy.legs import OpenDecode
from mooncake_vllm.proxy.limits import ClientSlot
from mooncake_vllm.proxy.prompt_list import StreamMerge

logger = logging.getLogger("mooncake_vllm.proxy")


def _abandon(response: http1.Response, in_flight: InFlight, client_slot: ClientSlot | None) -> None:
    # close(), not release(): the connection must drop so vLLM notices and aborts the request.
    response.close()
    in_flight.release()
    if client_slot is not None:
        client_slot.release()


def _record_cut(
    backends: Backends, ctx: RequestContext, leg: OpenDecode, e: Exception
) -> BackendFailure:
    """A decode leg whose read raised ``e`` mid-stream: the failure, recorded against its
    backend and logged. Re-raises ``e`` when it is not a backend failure."""
    failure = classify(e, "decode", leg.backend.url, leg.deadline)
    if failure is None:
        raise e
    backends.record_failure(leg.pool, leg.backend, failure)
    logger.warning("%s stream cut: %s", ctx.request_id, failure.message)
    return failure


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
            chunk = await leg.read_chunk()
        except (http1.BackendIOError, asyncio.TimeoutError) as e:
            failure = _record_cut(self._backends, self._ctx, leg, e)
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


def _abandon_all(
    legs: list[tuple[http1.Response, InFlight]], client_slot: ClientSlot | None
) -> None:
    for response, in_flight in legs:
        _abandon(response, in_flight, None)
    if client_slot is not None:
        client_slot.release()


class MergedStream:
    """The body of a streamed answer to a list of prompts: their decodes' streams, merged as
    vLLM merges them (``prompt_list.StreamMerge``).

    Each decode is read as its bytes arrive, one read in flight per decode, owned here: ended
    with the stream, or cancelled and awaited by ``aclose()``. A decode that fails mid-stream
    ends the whole stream with one error event, as in ``DecodeStream``; every other decode is
    then closed, so vLLM aborts its request. The client's slot, the finalizer and the end of
    the stream work as in ``DecodeStream``.
    """

    def __init__(
        self, backends: Backends, legs: list[OpenDecode], ctx: RequestContext, merge: StreamMerge
    ) -> None:
        self._backends = backends
        self._legs = legs
        self._ctx = ctx
        self._merge = merge
        self._open = set(range(len(legs)))  # decodes whose stream has not ended
        self._reads: dict[int, asyncio.Task[bytes]] = {}
        self._first_byte_seen = False
        self._finished = False
        if ctx.client_slot is not None:
            ctx.client_slot.hand_over()
        self._close = weakref.finalize(
            self,
            _abandon_all,
            [(leg.response, leg.in_flight) for leg in legs],
            ctx.client_slot,
        )

    def __aiter__(self) -> MergedStream:
        return self

    async def __anext__(self) -> bytes:
        while not self._finished:
            if not self._open:
                await self._finish()
                return self._merge.finish()
            for i in self._open - self._reads.keys():
                self._reads[i] = asyncio.create_task(self._legs[i].read_chunk())
            done, _ = await asyncio.wait(self._reads.values(), return_when=asyncio.FIRST_COMPLETED)
            i = min(i for i, task in self._reads.items() if task in done)
            leg = self._legs[i]
            try:
                chunk = self._reads.pop(i).result()
            except (http1.BackendIOError, asyncio.TimeoutError) as e:
                failure = _record_cut(self._backends, self._ctx, leg, e)
                await self._finish()
                # StreamMerge passes whole events only: no event is left cut in its middle.
                return rewrite.sse_error_event(failure.message, failure.kind.value)
            if not chunk:
                self._open.discard(i)
                leg.response.release()  # fully read: the connection may be reused
                leg.in_flight.release()
                continue
            if not self._first_byte_seen:
                self._first_byte_seen = True
                self._backends.metrics.first_decode_byte_seconds.observe(
                    time.monotonic() - self._ctx.started_s
                )
            out = self._merge.feed(i, chunk)
            if self._merge.failed:  # vLLM's own error event: the answer ends there
                await self._finish()
                return out + self._merge.finish()
            if out:
                return out
        raise StopAsyncIteration

    async def _finish(self) -> None:
        self._finished = True
        reads = list(self._reads.values())
        self._reads.clear()
        for task in reads:
            task.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        self._close()

    async def aclose(self) -> None:
        if not self._finished:
            logger.info(
                "%s client went away mid-stream; closing the decode streams", self._ctx.request_id
            )
        await self._finish()
