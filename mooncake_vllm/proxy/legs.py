"""The two legs of a generation request: the prefill leg, then the decode leg.

- ``prefill``: asks a prefill for one token and the handoff (``kv_transfer_params``) to its KV;
  safe to repeat, so a broken connection is retried on another prefill.
- ``open_decode``: sends the client's request with that handoff to a decode and waits for the
  status line; the body is then read whole (``read_decode``) or streamed (``stream.DecodeStream``).

Both go through ``Backends.call`` (``failover``), which picks the backend and handles failures.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from mooncake_vllm.proxy import rewrite
from mooncake_vllm.proxy.errors import FailureKind, LegDeadline, ProxyError, classify
from mooncake_vllm.proxy.failover import Attempt, Backends, InFlight, Reply, RequestContext
from mooncake_vllm.proxy.routing import Backend, BackendPool

logger = logging.getLogger("mooncake_vllm.proxy")

# Largest error body read from a backend.
_MAX_ERROR_BODY_BYTES = 64 * 1024


# ---- the prefill leg ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillOutcome:
    """What the prefill leg hands the decode leg.

    ``kv_transfer_params`` pass through as the prefill answered them: the decode's connector
    parses them into ``protocol.Handoff``, the proxy does not.
    """

    backend_url: str
    kv_transfer_params: dict[str, Any] | None  # None: the decode computes the prompt itself


async def prefill(backends: Backends, ctx: RequestContext, body: dict[str, Any]) -> PrefillOutcome:
    """Run the prefill leg; returns its outcome for the decode leg or raises ProxyError.

    The prefill leg is safe to repeat (it only fills a cache and returns one token), so a
    connection failure is retried once on another healthy prefill; an HTTP error is not.
    """
    pool_mode = backends.cfg.mode == "pool"
    transfer_id = None if pool_mode else rewrite.new_transfer_id()
    leg_body = rewrite.build_prefill_body(body, ctx.path, transfer_id)
    attempt = await backends.read_whole("prefill", ctx, "POST", data=rewrite.encode_json(leg_body))
    backend, reply = attempt.backend, attempt.answer
    backends.metrics.prefill_seconds.labels(backend.url).observe(reply.took_s)
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


@dataclass(frozen=True)
class OpenDecode:
    """A decode answer whose status line has arrived; the body is still unread."""

    pool: BackendPool
    backend: Backend
    response: aiohttp.ClientResponse
    in_flight: InFlight
    deadline: LegDeadline


async def open_decode(backends: Backends, ctx: RequestContext, body: bytes) -> OpenDecode:
    """Send the decode leg (JSON ``body``) and wait for its status line; the caller owns the result.

    Only a connection that was never opened is retried on another decode: once the decode
    has the request it may already be pulling the KV, and a transfer id is used once.
    """

    async def send(backend: Backend, deadline: LegDeadline) -> aiohttp.ClientResponse:
        return await backends.session.post(
            backend.url + ctx.path,
            data=body,
            headers=ctx.headers_for(backend, json_body=True),
            timeout=backends.timeout(deadline.timeout_s),
        )

    attempt = await backends.call("decode", ctx, send, repeatable=False)
    resp = attempt.answer
    logger.info("%s decode %s -> %d", ctx.request_id, attempt.backend.url, resp.status)
    return OpenDecode(attempt.pool, attempt.backend, resp, attempt.in_flight, attempt.deadline)


async def read_decode(backends: Backends, leg: OpenDecode) -> bytes:
    """The whole body of a decode answer; releases the connection whatever happens."""
    limit = None if 200 <= leg.response.status < 300 else _MAX_ERROR_BODY_BYTES
    try:
        if limit is None:
            raw = await leg.response.read()
        else:
            raw = await leg.response.content.read(limit)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
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
