"""A completion with several prompts: a prefill leg per distinct prompt, a decode request per
prompt, all at once, and one answer merged from theirs (``prompt_list``).

Every request of the list succeeds or the client gets the first failure (lowest prompt index
among those failed when it is seen) with its status and error body, as from a single prompt;
the other legs are cancelled then, and their open decode answers closed, so vLLM aborts them.

Memory is bounded per request, not per prompt: the per-prompt bodies share the client body's
values (``prompt_list.body_for`` copies one dict level), and a leg's JSON bytes, the only
full-size copy, exist only while that leg is being sent. At most ``--prompt-list-concurrency``
legs of one list are being sent at once (``_LegSlots``), so a list of N prompts in front of a
large shared field holds that many encoded bodies, not N (before: 100 prompts beside 4 MiB of
shared fields took the proxy from 67 to 932 MiB).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from mooncake_vllm.proxy import legs, prompt_list, rewrite
from mooncake_vllm.proxy.asgi import Answer
from mooncake_vllm.proxy.errors import ProxyError
from mooncake_vllm.proxy.failover import Backends, RequestContext, with_route_keys
from mooncake_vllm.proxy.legs import OpenDecode
from mooncake_vllm.proxy.stream import MergedStream

logger = logging.getLogger("mooncake_vllm.proxy")

T = TypeVar("T")


async def generate_each_prompt(
    backends: Backends, ctx: RequestContext, body: dict[str, Any], prompts: list[Any]
) -> Answer:
    """Serve ``body``, whose ``prompt`` is the list ``prompts``, prompt by prompt."""
    plan = prompt_list.plan(prompts)
    bodies = [prompt_list.body_for(body, prompt) for prompt in plan.distinct]
    contexts = [_context_for(backends, ctx, b) for b in bodies]
    slots = asyncio.Semaphore(backends.cfg.prompt_list_concurrency)
    prefills = [
        asyncio.create_task(_prefill(backends, c, b, slots))
        for c, b in zip(contexts, bodies, strict=True)
    ]
    logger.info("%s: %d prompts, %d prefill legs", ctx.request_id, len(prompts), len(plan.distinct))
    stream = rewrite.wants_stream(body)
    try:
        # Each prompt's decode opens as soon as its own prefill is done.
        answers = [
            _decode(backends, contexts[leg], bodies[leg], prefills[leg], stream, slots)
            for leg in plan.leg_of
        ]
        if not stream:
            merged = prompt_list.merge_answers(await _all_or_none(answers, lambda _: None))
            backends.metrics.first_decode_byte_seconds.observe(time.monotonic() - ctx.started_s)
            return Answer(200, rewrite.encode_json(merged))
        decodes: list[OpenDecode] = await _all_or_none(answers, legs.close_decode)
    finally:
        for task in prefills:  # only left running when a decode failed first
            task.cancel()
        await asyncio.gather(*prefills, return_exceptions=True)
    choices_per_prompt = body.get("n") or 1
    merge = prompt_list.StreamMerge(len(prompts), choices_per_prompt)
    return Answer.event_stream(200, MergedStream(backends, decodes, ctx, merge))


def _context_for(backends: Backends, ctx: RequestContext, body: dict[str, Any]) -> RequestContext:
    return with_route_keys(ctx, body, backends.cfg.policy)


async def _prefill(
    backends: Backends, ctx: RequestContext, body: dict[str, Any], slots: asyncio.Semaphore
) -> legs.PrefillOutcome:
    """One distinct prompt's prefill leg, sent when one of the list's leg slots is free."""
    async with slots:
        return await legs.prefill(backends, ctx, body)


async def _open_decode(
    backends: Backends,
    ctx: RequestContext,
    body: dict[str, Any],
    outcome: legs.PrefillOutcome,
    slots: asyncio.Semaphore,
) -> OpenDecode:
    """One prompt's decode leg sent and opened up to its first token, in one of the list's leg
    slots: its encoded body lives only in here."""
    async with slots:
        data = rewrite.encode_json(rewrite.build_decode_body(body, outcome.kv_transfer_params))
        return await legs.open_decode_ok(backends, ctx, data)


async def _decode(
    backends: Backends,
    ctx: RequestContext,
    body: dict[str, Any],
    prefill: asyncio.Task[legs.PrefillOutcome],
    stream: bool,
    slots: asyncio.Semaphore,
) -> Any:
    """One prompt's decode once its prefill is done: its answer parsed (not streamed) or open."""
    # Shielded: several prompts may wait on one prefill, which only its owner cancels.
    outcome = await asyncio.shield(prefill)
    leg = await _open_decode(backends, ctx, body, outcome, slots)
    if stream:
        return leg
    raw = await legs.read_decode(backends, leg)
    try:
        answer = rewrite.decode_json(raw)
    except ValueError as e:
        backends.metrics.backend_errors.labels("decode", leg.backend.url, "bad_answer").inc()
        raise ProxyError.of(
            502, f"decode backend {leg.backend.url} answered with non-JSON", "backend_error"
        ) from e
    if not isinstance(answer, dict):
        raise ProxyError.of(
            502, f"decode backend {leg.backend.url} answered with a non-object", "backend_error"
        )
    return answer


async def _all_or_none(
    coros: list[Coroutine[Any, Any, T]], release: Callable[[T], None]
) -> list[T]:
    """The results of ``coros``, run at once, in order; or the first failure.

    On a failure, or when the caller is cancelled, the others are cancelled and awaited, and
    ``release`` gets each result that was already there.
    """
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        if not all(t.done() and not t.cancelled() and t.exception() is None for t in tasks):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks:
                if not task.cancelled() and task.exception() is None:
                    release(task.result())
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    return [t.result() for t in tasks]
