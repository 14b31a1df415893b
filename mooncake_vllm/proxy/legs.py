"""The two legs of a generation request: the prefill leg, then the decode leg.

- ``prefill``: asks a prefill for one token and the handoff (``kv_transfer_params``) to its KV;
  safe to repeat, so a broken connection is retried on another prefill.
- ``open_decode``: sends the client's request with that handoff to a decode and reads its answer
  up to the first token (a draining decode's refusal is sent to another decode, ``drain``); the
  body is then read whole (``read_decode``) or streamed (``stream.DecodeStream``).

Both go through ``Backends.call`` (``failover``), which picks the backend and handles failures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.proxy import drain, http1, rewrite
from mooncake_vllm.proxy.errors import (
    FailureKind,
    LegDeadline,
    LoadFailed,
    PoolExhausted,
    ProxyError,
    classify,
)
from mooncake_vllm.proxy.failover import Attempt, Backends, InFlight, Reply, RequestContext
from mooncake_vllm.proxy.routing import Backend, BackendPool

logger = logging.getLogger("mooncake_vllm.proxy")

# Largest error body read from a backend (``drain.read_head`` has read its start).
_MAX_ERROR_BODY_BYTES = drain.MAX_HEAD_BYTES


# ---- the prefill leg ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillOutcome:
    """What the prefill leg hands the decode leg.

    ``kv_transfer_params`` pass through as the prefill answered them: the decode's connector
    parses them into ``protocol.Handoff``, the proxy does not.
    """

    backend_url: str | None  # None: no prefill could take the leg (``local``)
    kv_transfer_params: dict[str, Any] | None  # None: the decode computes the prompt itself

    @property
    def local(self) -> bool:
        """No prefill served the leg: the decode gets a plain request and computes the prompt."""
        return self.backend_url is None


async def prefill(
    backends: Backends,
    ctx: RequestContext,
    body: dict[str, Any],
    transfer_id: str | None = None,
    before_send: Callable[[Backend], object] | None = None,
) -> PrefillOutcome:
    """Run the prefill leg; returns its outcome for the decode leg or raises ProxyError.

    The prefill leg is safe to repeat (it only fills a cache and returns one token), so a
    connection failure is retried once on another healthy prefill, and a draining prefill's
    refusal on the next one; an HTTP error is not. When no prefill took the leg (none healthy,
    all draining, unreachable or dropping it) the outcome is ``local``: the decode gets the
    request without a handoff and computes the prompt itself, as a plain vLLM would (a
    ``kv_consumer`` computes what it is not handed). ``transfer_id``: the one to ask for
    (default: a new one; none in pool mode); ``before_send``: told each prefill the leg goes to
    (``concurrent``).
    """
    if backends.cfg.mode == "pool":
        transfer_id = None
    elif transfer_id is None:
        transfer_id = rewrite.new_transfer_id()
    leg_body = rewrite.encode_json(rewrite.build_prefill_body(body, ctx.path, transfer_id))
    try:
        attempt = await backends.read_whole(
            "prefill", ctx, "POST", data=leg_body, before_send=before_send
        )
    except PoolExhausted as e:
        backends.served_locally(ctx, str(e))
        logger.info("%s prefill: none can take it; the decode computes the prompt", ctx.request_id)
        return PrefillOutcome(None, None)
    backend, reply = attempt.backend, attempt.answer
    backends.prefill_served(backend.url)
    backends.metrics.prefill_seconds_of(backend.url).observe(reply.took_s)
    if 200 <= reply.status < 300:
        backend.record_prefill(reply.took_s, reply.bytes_in_flight)
    logger.info("%s prefill %s -> %d", ctx.request_id, backend.url, reply.status)
    return _prefill_outcome(backends, ctx, attempt)


def _prefill_outcome(
    backends: Backends, ctx: RequestContext, attempt: Attempt[Reply]
) -> PrefillOutcome:
    metrics, backend, reply = backends.metrics, attempt.backend, attempt.answer
    if not 200 <= reply.status < 300:
        if reply.status >= 500:
            metrics.backend_errors.labels("prefill", backend.url, "http_5xx").inc()
        raise ProxyError(
            reply.status, rewrite.backend_error_body("prefill", reply.status, reply.body)
        )
    try:
        answer = rewrite.decode_json(reply.body)
    except ValueError as e:
        metrics.backend_errors.labels("prefill", backend.url, "bad_answer").inc()
        raise ProxyError.of(
            502, f"prefill backend {backend.url} answered with non-JSON", "backend_error"
        ) from e
    if backends.cfg.mode == "pool":
        return PrefillOutcome(backend.url, None)  # the decode finds the prompt in the pool
    params = rewrite.handoff_from_prefill(answer)
    if params is None:
        metrics.missing_handoff.labels(backend.url).inc()
        logger.warning(
            "%s prefill %s returned no kv_transfer_params (is the KV connector configured "
            "as producer?); the decode will compute the prompt itself",
            ctx.request_id,
            backend.url,
        )
    return PrefillOutcome(backend.url, params)


# ---- the decode leg -----------------------------------------------------------------------------


@dataclass(eq=False)
class OpenDecode:
    """A decode answer read up to its first token (``drain.read_head``); the rest is unread."""

    pool: BackendPool
    backend: Backend
    response: http1.Response
    in_flight: InFlight
    deadline: LegDeadline
    # What was read to tell the answer from a draining decode's refusal: a stream up to its
    # first token, an error body's start (a whole 2xx answer stays in ``response``). Readers
    # of the body pass it on first (``read_chunk``, ``read_decode``).
    head: bytes = b""

    async def read_chunk(self) -> bytes:
        """The body's next bytes as they arrive, the head first; b"" at its end."""
        if self.head:
            head, self.head = self.head, b""
            return head
        return await self.response.read_some()


async def open_decode(backends: Backends, ctx: RequestContext, body: bytes) -> OpenDecode:
    """Send the decode leg (JSON ``body``) and read its answer up to the first token; the caller
    owns the result.

    Only a connection that was never opened, or a refusal by a draining decode, is retried on
    another decode: that decode did not act on the request. Once a decode has the request it
    may already be pulling the KV, and a transfer id is used once.
    """

    async def send(backend: Backend, deadline: LegDeadline) -> tuple[http1.Response, bytes]:
        resp = await backends.client.request(
            "POST",
            backend.url,
            ctx.path,
            headers=ctx.headers_for(backend, json_body=True),
            body=body,
            timeout_s=deadline.timeout_s,
        )
        try:
            return resp, await drain.read_head(resp, "decode", backend.url)
        except BaseException:
            resp.close()
            raise

    attempt = await backends.call("decode", ctx, send, repeatable=False)
    resp, head = attempt.answer
    logger.info("%s decode %s -> %d", ctx.request_id, attempt.backend.url, resp.status)
    return OpenDecode(
        attempt.pool, attempt.backend, resp, attempt.in_flight, attempt.deadline, head
    )


async def open_decode_ok(
    backends: Backends, ctx: RequestContext, body: bytes, *, resendable: bool = False
) -> OpenDecode:
    """``open_decode``, and a decode that answered with an error status becomes the client's
    ``ProxyError`` (its body passed on; a 5xx counted against the backend).

    ``resendable``: the leg carries a handoff the caller can replace; a decode whose load of it
    failed before any token (``drain.failed_before_a_token``) raises ``LoadFailed``, streamed
    or not, and its answer is closed."""
    leg = await open_decode(backends, ctx, body)
    status = leg.response.status
    if resendable and drain.failed_before_a_token(status, leg.head):
        backends.metrics.backend_errors.labels("decode", leg.backend.url, "load_failed").inc()
        raw = leg.head
        close_decode(leg)
        raise LoadFailed(status, rewrite.backend_error_body("decode", status, raw))
    if not 200 <= status < 300:
        raw = await read_decode(backends, leg)
        if status >= 500:
            backends.metrics.backend_errors.labels("decode", leg.backend.url, "http_5xx").inc()
        raise ProxyError(status, rewrite.backend_error_body("decode", status, raw))
    leg.in_flight.settle()  # pulled, and its first token out: no longer the decode's queue
    return leg


def close_decode(leg: OpenDecode) -> None:
    """Closes an open decode answer unread: close(), not release(), so vLLM sees the connection
    go and aborts the request."""
    leg.response.close()
    leg.in_flight.release()


async def read_decode(backends: Backends, leg: OpenDecode) -> bytes:
    """The whole body of a decode answer; releases the connection whatever happens."""
    limit = None if 200 <= leg.response.status < 300 else _MAX_ERROR_BODY_BYTES
    try:
        if limit is None:
            raw = leg.head + await leg.response.read()
        else:
            raw = leg.head + await leg.response.read_some(limit - len(leg.head))
    except (http1.BackendIOError, asyncio.TimeoutError) as e:
        failure = classify(e, "decode", leg.backend.url, leg.deadline)
        if failure is None:
            raise
        backends.record_failure(leg.pool, leg.backend, failure)
        status = 504 if failure.kind is FailureKind.TIMEOUT else 502
        raise ProxyError.of(status, failure.message, failure.kind.value) from e
    finally:
        # release() keeps a fully read connection for reuse and closes any other.
        leg.response.release()
        leg.in_flight.release()
    return raw
