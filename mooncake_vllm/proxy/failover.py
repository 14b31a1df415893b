"""Calling a backend: the pools, the HTTP client, and the one failover path both legs take.

``Backends.call`` is what happens when a backend fails: it picks a healthy backend of the pool,
gives the call the leg's deadline, counts it in flight, classifies an exception (``errors``), and
retries once on another backend when that backend cannot have acted on the request (it could not
be reached, or it refused the request because it is shutting down: ``drain``), or when the call
is safe to repeat. The prefill leg, ``GET /v1/models`` (``Backends.read_whole``) and the decode
leg up to its first token all go through it.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from mooncake_vllm.core import tracing
from mooncake_vllm.proxy import drain, http1, kv_index, prefix
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.errors import (
    BackendFailure,
    FailureKind,
    LegDeadline,
    PoolExhausted,
    ProxyError,
    classify,
)
from mooncake_vllm.proxy.limits import ClientSlot
from mooncake_vllm.proxy.metrics import ProxyMetrics
from mooncake_vllm.proxy.producers import Producers
from mooncake_vllm.proxy.routing import Backend, BackendPool, Backoff, NoHealthyBackend, Policy

logger = logging.getLogger("mooncake_vllm.proxy")

# vLLM's uvicorn closes idle keep-alive connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
# Dropping ours first avoids sending a request on a connection the server is closing, which
# would look like a dead backend.
_KEEPALIVE_S = 4.0
# Connections per backend; more requests than this wait for a free one.
_CONNECTIONS_PER_BACKEND = 1000
# The first backend and at most one other (the failure table in app.py): a client waits for at
# most two failing backends before it gets the error (draining ones, which refuse at once, are
# passed over without counting).
_ATTEMPTS = 2
# The message of the cancellation ``Backends.abandon`` sends a call waiting on a backend that left.
_ABANDONED = "mooncake-proxy: backend left its pool"

T = TypeVar("T")
# The trace context of the leg being sent (its span's, with tracing on), set by ``Backends.call``
# around its ``send``: ``RequestContext.headers_for`` adds it to the leg's headers.
_LEG_TRACE: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "mooncake_leg_trace", default=None
)


@dataclass(frozen=True)
class RequestContext:
    """What every leg of one client request needs, passed explicitly from the route handler."""

    request_id: str
    started_s: float  # time.monotonic() at arrival; --timeout-s counts from here
    path: str  # the client's path, which both legs call on their backend
    # Headers for a trusted backend and for one that is not (``rewrite.backend_headers``).
    trusted_headers: Mapping[str, str]
    untrusted_headers: Mapping[str, str]
    # The prompt's prefix key (``prefix.prefix_key``): the prefill pool routes on it under
    # --policy prefix, both pools under kv; None for requests without a prompt.
    prefix_key: bytes | None = None
    # The prompt's token ids when the client sent ids (``kv_index.prompt_token_ids``): both
    # pools match them against their engines' caches under --policy kv.
    prompt_token_ids: Sequence[int] | None = None
    # The model the request names and its cache_salt: what keys its KV besides the tokens.
    prompt_identity: tuple[str | None, str | None] = (None, None)
    # The client's admission under --client-* limits; a streamed answer releases it when it ends.
    client_slot: ClientSlot | None = None
    # The trace context the legs go out under (``asgi.Incoming.trace_parent``); {}: none.
    trace_parent: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def headers_for(self, backend: Backend, *, json_body: bool = False) -> Mapping[str, str]:
        """The headers of a call to ``backend``; ``json_body``: a POST of JSON bytes; the leg's
        ``traceparent`` when there is a trace."""
        headers = self.trusted_headers if backend.trusted else self.untrusted_headers
        trace = _LEG_TRACE.get()
        if trace is None:
            trace = self.trace_parent
        if trace:
            headers = {**headers, **trace}
        return {**headers, "Content-Type": "application/json"} if json_body else headers


class InFlight:
    """One request outstanding on a backend; ``release()`` is idempotent: call it on any path."""

    def __init__(
        self, pool: BackendPool, backend: Backend, metrics: ProxyMetrics, span: Any = None
    ) -> None:
        self._pool = pool
        self._backend = backend
        self._gauge = metrics.in_flight_of(pool.role, backend.url)
        self._released = False
        self._tokens = pool.begin(backend)
        self._gauge.set(backend.in_flight)
        self.span = span  # the leg's span (tracing on): it ends with the leg

    def settle(self) -> None:
        """The leg's work is done though it stays in flight (a decode that has pulled and sent
        its first token): its tokens leave the engine's queue (``Backend.tokens_in_flight``)."""
        if not self._released:
            self._pool.settle(self._backend, self._tokens)
            self._tokens = 0

    def release(self, error: str | None = None) -> None:
        if self._released:
            return
        self._released = True
        self._pool.end(self._backend, self._tokens)
        self._gauge.set(self._backend.in_flight)
        tracing.end(self.span, error)


@dataclass(frozen=True)
class Attempt(Generic[T]):
    """A backend call that got an answer; ``in_flight`` is the caller's to release."""

    pool: BackendPool
    backend: Backend
    deadline: LegDeadline
    in_flight: InFlight
    answer: T


@dataclass(frozen=True)
class Reply:
    """A backend answer read whole."""

    status: int
    body: bytes
    content_type: str
    took_s: float
    bytes_in_flight: int = 0  # request bytes on the backend when this one was sent, its own too


class Backends:
    """The prefill and decode pools of one app, the HTTP session to them, and their metrics."""

    def __init__(self, cfg: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        backoff = Backoff(initial_s=1.0, max_s=30.0)
        # Spans of each leg (--otlp-traces-endpoint; None: off, nothing imported).
        self.tracer = tracing.tracer(cfg.otlp_traces_endpoint, tracing.PROXY_SERVICE)
        # What the engines' prefix caches hold (--policy kv), fed by ``kv_events``.
        self.cache = kv_index.KvIndex() if cfg.policy is Policy.KV else None
        self.pools = {
            role: BackendPool(
                role,
                urls,
                cfg.policy,
                backoff=backoff,
                probe_interval_s=cfg.health_interval_s,
                cache=self.cache,
            )
            for role, urls in (("prefill", cfg.prefill), ("decode", cfg.decode))
        }
        for role, pool in self.pools.items():
            metrics.declare_backends(role, [b.url for b in pool.backends])
        self._client: http1.Client | None = None
        # Where each prefill's side channel is (--dispatch concurrent).
        self.producers = Producers()
        # The calls waiting for each backend's answer, and those ``abandon`` cancelled.
        self._waiting: dict[Backend, set[asyncio.Task]] = {}
        self._abandoned: set[asyncio.Task] = set()
        # Requests sent to a decode as plain requests since no prefill could take them (the
        # episode ends with the next prefill leg a prefill serves); None: none since then.
        self._local_requests: int | None = None

    # ---- the HTTP client (before_serving / after_serving) ---------------------------------------

    async def open(self) -> None:
        self._client = http1.Client(
            keepalive_s=_KEEPALIVE_S,
            connect_timeout_s=self.cfg.connect_timeout_s,
            limit_per_host=_CONNECTIONS_PER_BACKEND,
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def client(self) -> http1.Client:
        if self._client is None:
            raise RuntimeError("the proxy is not serving (before_serving has not run)")
        return self._client

    # ---- what a failure does to a backend -------------------------------------------------------

    def report_ejection(self, pool: BackendPool, backend: Backend, reason: str) -> None:
        """Count and log a backend that was just taken out of rotation."""
        self.metrics.ejections.labels(pool.role, backend.url).inc()
        logger.warning("%s backend %s ejected: %s", pool.role, backend.url, reason)

    def record_failure(self, pool: BackendPool, backend: Backend, failure: BackendFailure) -> None:
        """Count a failed call; a connection failure also ejects the backend, a late answer not,
        and a refusal because it is shutting down keeps it out until it has restarted."""
        self.metrics.backend_errors.labels(pool.role, backend.url, failure.kind.value).inc()
        if failure.kind is FailureKind.TIMEOUT:
            return
        if failure.kind is FailureKind.DRAINING:
            ejected = pool.drain(backend, failure.message)
        else:
            ejected = pool.eject(backend, failure.message)
        if ejected:
            self.report_ejection(pool, backend, failure.message)

    def served_locally(self, ctx: RequestContext, why: str) -> None:
        """Count a request whose prompt a decode computes because no prefill could take it
        (``legs.prefill``); the first of an episode is logged with ``why``."""
        self.metrics.dispatched.labels("local").inc()
        if self._local_requests is None:
            self._local_requests = 0
            logger.warning(
                "%s no prefill can take requests (%s): decodes compute prompts themselves until "
                'one can (counted in mooncake_proxy_dispatched_total{how="local"})',
                ctx.request_id,
                why,
            )
        self._local_requests += 1

    def prefill_served(self, url: str) -> None:
        """A prefill answered a leg: an episode of ``served_locally`` requests has ended."""
        if self._local_requests is not None:
            logger.warning(
                "prefill %s serves again: %d requests were computed by decodes meanwhile",
                url,
                self._local_requests,
            )
            self._local_requests = None

    def abandon(self, backend: Backend) -> int:
        """``backend`` has left its pool because its engine stopped (discovery: its registry
        record was deleted). The calls still waiting for its answer are sent to other backends;
        returns how many.

        A vLLM deletes its record once it has drained, so it runs nothing then: a call still
        waiting was accepted by an API server whose engine is gone, and vLLM 0.32 answers it
        only when the client gives up (``drain``)."""
        waiting = self._waiting.pop(backend, set())
        for task in waiting:
            self._abandoned.add(task)
            task.cancel(_ABANDONED)
        return len(waiting)

    async def _answer(self, backend: Backend, call: Awaitable[T], role: str) -> T:
        """``call``'s result, awaited in the caller's task, which ``abandon`` may cancel while
        it waits; an abandoned call raises ``drain.BackendDraining``.

        No task of its own: a task per backend call showed up in the proxy's profile. The
        cancellation ``abandon`` sends carries ``_ABANDONED`` as its message; any other (the
        client went away) passes through, as does ours when the task was also cancelled by
        someone else meanwhile.
        """
        task = asyncio.current_task()
        assert task is not None
        waiting = self._waiting.setdefault(backend, set())
        waiting.add(task)
        try:
            return await call
        except asyncio.CancelledError as e:
            if task not in self._abandoned or e.args != (_ABANDONED,):
                raise
            if task.uncancel() > 0:  # cancelled for another reason too: that one wins
                raise
            raise drain.BackendDraining(role, backend.url, drain.LEFT) from None
        finally:
            waiting.discard(task)
            self._abandoned.discard(task)
            if not waiting and self._waiting.get(backend) is waiting:
                del self._waiting[backend]

    # ---- one call, with failover ----------------------------------------------------------------

    async def call(
        self,
        role: str,
        ctx: RequestContext,
        send: Callable[[Backend, LegDeadline], Awaitable[T]],
        *,
        repeatable: bool,
    ) -> Attempt[T]:
        """``send(backend, deadline)`` to a healthy backend of the ``role`` pool, failing over once.

        A connection that was never opened is retried on another backend: that backend never
        saw the request; so is a request the backend refused because it is shutting down
        (``send`` raised ``drain.BackendDraining``), or one still waiting for a backend that has
        left its pool (``abandon``). One that broke later is retried only when
        the call is ``repeatable``. A missed deadline is never retried (504): the backend may
        just be busy. Each failure is counted, and a connection failure or a refusal ejects the
        backend. Raises ProxyError: 502 when the backends failed, 503 when the pool had no
        healthy backend to begin with; both as ``PoolExhausted`` when no backend tried acted on
        the call. ``send`` cleans up after itself when it is cancelled (the client went away):
        it runs in the caller's task, so an answer it returned is never dropped.
        """
        pool = self.pools[role]
        tried: list[Backend] = []
        last: BackendFailure | None = None
        # A draining backend's refusal comes at once and takes it out of rotation, so it costs
        # no attempt: a leg goes on to the next backend until one serves or the pool is empty.
        counted = 0
        while counted < _ATTEMPTS:
            backend = _pick(pool, tried, last, ctx)
            deadline = LegDeadline.of(self.cfg, ctx.started_s, prefill=pool.role == "prefill")
            span = None
            if self.tracer is not None:
                attributes = {"mooncake.backend": backend.url, "mooncake.attempt": len(tried) + 1,
                              "mooncake.request_id": ctx.request_id}  # fmt: skip
                span = tracing.start(self.tracer, f"proxy.{role}", ctx.trace_parent, "CLIENT",
                                     attributes)  # fmt: skip
            in_flight = InFlight(pool, backend, self.metrics, span)
            leg_trace = _LEG_TRACE.set(tracing.headers_of(span) if span is not None else None)
            try:
                answer = await self._answer(backend, send(backend, deadline), pool.role)
            except BaseException as e:  # a cancelled call gives its in-flight count back too
                failure = classify(e, pool.role, backend.url, deadline)
                in_flight.release(failure.message if failure is not None else type(e).__name__)
                if failure is None:
                    raise
                self.record_failure(pool, backend, failure)
                if failure.kind is FailureKind.TIMEOUT:
                    raise ProxyError.of(504, failure.message, "timeout") from e
                untouched = failure.kind in (FailureKind.CONNECT, FailureKind.DRAINING)
                if not untouched and not repeatable:
                    raise ProxyError.of(502, failure.message, "backend_error") from e
                logger.warning("%s %s", ctx.request_id, failure.message)
                tried.append(backend)
                counted += failure.kind is not FailureKind.DRAINING
                last = failure
                continue
            finally:
                _LEG_TRACE.reset(leg_trace)
            return Attempt(pool, backend, deadline, in_flight, answer)
        assert last is not None
        raise PoolExhausted.of(502, last.message, "backend_error")

    async def read_whole(
        self,
        role: str,
        ctx: RequestContext,
        method: str,
        data: bytes | None = None,
        before_send: Callable[[Backend], object] | None = None,
    ) -> Attempt[Reply]:
        """One short, repeatable call to ``ctx.path`` on the ``role`` pool, read whole; ``data``:
        a JSON body (a generation: a draining backend's refusal of it is retried elsewhere).
        ``before_send``: told each backend tried, before the call goes to it."""

        async def send(backend: Backend, deadline: LegDeadline) -> Reply:
            size = len(data or b"")
            backend.bytes_in_flight += size
            try:
                if before_send is not None:
                    before_send(backend)
                sent_s, bytes_in_flight = time.monotonic(), backend.bytes_in_flight
                resp = await self.client.request(
                    method,
                    backend.url,
                    ctx.path,
                    headers=ctx.headers_for(backend, json_body=data is not None),
                    body=data,
                    timeout_s=deadline.timeout_s,
                )
                try:
                    raw = await resp.read()
                finally:
                    resp.release()
                content_type = resp.headers.get("content-type", "application/json")
            finally:
                backend.bytes_in_flight -= size
            why = drain.refusal(resp.status, raw) if data is not None else None
            if why is not None:
                raise drain.BackendDraining(role, backend.url, why)
            return Reply(resp.status, raw, content_type, time.monotonic() - sent_s, bytes_in_flight)

        attempt = await self.call(role, ctx, send, repeatable=True)
        attempt.in_flight.release()  # the answer is read: the backend is done with it
        return attempt


def with_route_keys(ctx: RequestContext, body: Mapping[str, Any], policy: Policy) -> RequestContext:
    """``ctx`` with what ``policy`` routes ``body`` on (nothing for round robin and least
    outstanding)."""
    if policy is Policy.PREFIX:
        return dataclasses.replace(ctx, prefix_key=prefix.prefix_key(body))
    if policy is Policy.KV:
        return dataclasses.replace(
            ctx,
            prefix_key=prefix.prefix_key(body),
            prompt_token_ids=kv_index.prompt_token_ids(body),
            prompt_identity=prefix.prompt_identity(body),
        )
    return ctx


def _pick(
    pool: BackendPool, tried: list[Backend], last: BackendFailure | None, ctx: RequestContext
) -> Backend:
    # Prefix routing keeps a chat on one prefill; the decode side has no key there (it
    # cannot see what a decode holds) and goes by least outstanding. KV routing sees both.
    by_prompt = pool.policy is Policy.KV or pool.role == "prefill"
    try:
        return pool.pick(
            exclude=tried,
            key=ctx.prefix_key if by_prompt else None,
            token_ids=ctx.prompt_token_ids if by_prompt else None,
            identity=ctx.prompt_identity,
        )
    except NoHealthyBackend as e:
        if last is not None:  # the pool ran out while failing over: report the real cause
            raise PoolExhausted.of(502, last.message, "backend_error") from e
        raise PoolExhausted.of(503, str(e), "service_unavailable") from e
