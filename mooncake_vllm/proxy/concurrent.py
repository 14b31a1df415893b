"""``--dispatch concurrent``: the decode request goes out with the prefill request, not after it.

The proxy picks the prefill, chooses the transfer id and sends the prefill leg as in sequential
dispatch; at the same time it sends the decode leg with a *pending* handoff: that id and where the
chosen prefill's side channel is (``protocol.PendingHandoff``), learnt from that prefill's earlier
handoffs (``Producers``). The decode admits the request, allocates its blocks and parks it until
the KV arrives; its worker's acquire waits at the prefill's lease server until the prefill's
request has finished, and is then granted the handoff, checked before a byte moves. So the
decode's request handling overlaps the prefill's compute instead of following it.

A prefill not heard from yet (the proxy's first request to it, or one whose handoffs name no side
channel) is served sequentially, and its handoff is remembered. So is a request to a prefill
expected to answer later than ``--concurrent-max-wait-s`` (``Backend.expected_wait_s``: a deep
queue): its decode would hold blocks meanwhile and could run into its ``load_timeout_s``.

Failures end both legs: a prefill that fails, or hands over from another producer than the one
the decode waits on (it restarted), cancels the decode leg (the decode aborts the request and
withdraws its wait: its blocks are freed) and, for a changed producer, sends the decode leg again
with the real handoff; a decode that fails first cancels the prefill leg; a client that goes away
cancels both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from mooncake_vllm.proxy import legs, rewrite
from mooncake_vllm.proxy.failover import Backends, RequestContext
from mooncake_vllm.proxy.legs import OpenDecode
from mooncake_vllm.proxy.producers import producer_of
from mooncake_vllm.proxy.routing import Backend

logger = logging.getLogger("mooncake_vllm.proxy")


def pending_handoff(producer: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pending": True,
        "transfer_id": transfer_id,
        **producer,
    }


async def open_both(
    backends: Backends,
    ctx: RequestContext,
    body: dict[str, Any],
    raw: bytes,
    *,
    resendable: bool = False,
) -> OpenDecode:
    """Both legs of one prompt; the decode's answer opened up to its first token.
    ``resendable``: see ``legs.open_decode_ok``. When no prefill can take the leg
    (``PrefillOutcome.local``) the decode leg is sent again as a plain request."""
    transfer_id = rewrite.new_transfer_id()
    decode: asyncio.Task[OpenDecode] | None = None
    waits_on: dict[str, Any] | None = None  # the producer the decode leg waits on
    queued = False  # the decode leg waits for the answer: the prefill's queue is too deep
    sent = asyncio.Event()  # a decode leg was sent (it may fail before the prefill answers)

    def start_decode(backend: Backend) -> None:
        nonlocal decode, waits_on, queued
        _cancel(decode)  # a retry on another prefill: the decode waited on the first one
        decode, waits_on = None, backends.producers.get(backend.url)
        queued = waits_on is not None and (
            backend.expected_wait_s() > backends.cfg.concurrent_max_wait_s
        )
        if waits_on is not None and not queued:
            data = rewrite.decode_body_bytes(raw, body, pending_handoff(waits_on, transfer_id))
            decode = asyncio.create_task(
                legs.open_decode_ok(backends, ctx, data, resendable=resendable)
            )
            sent.set()

    prefill = asyncio.create_task(legs.prefill(backends, ctx, body, transfer_id, start_decode))
    try:
        await _first_failure(prefill, lambda: decode, sent)
        outcome = prefill.result()
    except BaseException:
        prefill.cancel()
        _cancel(decode)
        with contextlib.suppress(BaseException):
            await prefill
        raise
    handoff = outcome.kv_transfer_params
    if outcome.local:  # counted by legs.prefill; a decode leg sent waits on a prefill that is gone
        _cancel(decode)
        return await legs.open_decode_ok(backends, ctx, rewrite.decode_body_bytes(raw, body, None))
    backends.producers.learn(outcome.backend_url, handoff)
    dispatched = backends.metrics.dispatched
    if decode is not None and waits_on == producer_of(handoff):
        dispatched.labels("concurrent").inc()
        return await decode
    how = "resent" if decode is not None else "queued" if queued else "sequential"
    dispatched.labels(how).inc()
    if decode is not None:  # the decode waits on another producer than the one that holds it
        logger.warning(
            "%s prefill %s handed over from another producer than the decode waited on (it "
            "restarted?): the decode leg is sent again",
            ctx.request_id,
            outcome.backend_url,
        )
        _cancel(decode)
    data = rewrite.decode_body_bytes(raw, body, handoff)
    return await legs.open_decode_ok(
        backends, ctx, data, resendable=resendable and handoff is not None
    )


async def _first_failure(prefill: asyncio.Task, decode, sent: asyncio.Event) -> None:
    """Waits for the prefill leg, and raises its failure; raises at once if the decode leg
    (``decode()``: the current one, None before one was sent; ``sent`` is set when one is)
    fails first (it cannot admit the request, or it is down): its error is the client's."""
    while not prefill.done():
        current = decode()
        waiting: set[asyncio.Future] = {prefill}
        if current is not None and not current.done():
            waiting.add(current)
        elif current is None:
            waiting.add(asyncio.ensure_future(sent.wait()))
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for other in waiting - {prefill, current}:
                other.cancel()
        sent.clear()
        current = decode()
        if current is not None and current.done() and not current.cancelled():
            if current.exception() is not None:
                raise current.exception()
            await asyncio.wait({prefill})  # it answered first: only the prefill is left
    prefill.result()


def _cancel(task: asyncio.Task[OpenDecode] | None) -> None:
    """Ends a decode leg: cancelled in flight, or its open answer closed (vLLM aborts it)."""
    if task is None:
        return
    if not task.done():
        task.cancel()
        return
    if not task.cancelled() and task.exception() is None:
        legs.close_decode(task.result())
