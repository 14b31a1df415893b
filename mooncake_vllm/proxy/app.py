"""The proxy's Quart app: for each request, a prefill leg, then a decode leg streamed back.

Where to look:

- ``Proxy.prefill``: the prefill leg, its retry on another prefill, and the handoff it returns;
- ``Proxy.open_decode``: the decode leg up to its status line;
- ``DecodeStream``: streaming the decode's answer and what happens when either side goes away;
- ``Proxy.probe_forever``: the background health prober;
- ``create_app``: the routes, auth, and the error handlers that keep every answer OpenAI-shaped.

Failures and what the client sees:

======================================  =====================================================
prefill or decode answers 4xx/5xx       that status, with the backend's error body
a backend refuses/resets the connection the backend is ejected; 502 (the prefill leg is retried
                                        once on another prefill first, the decode leg only
                                        when the connection was never opened)
no healthy backend in a pool            503 naming the pool
prefill or decode misses its deadline   504 naming the deadline and its flag
decode fails mid-stream                 a final ``data: {"error": ...}`` event, then the end
client goes away mid-stream             the decode connection is closed, so vLLM aborts
======================================  =====================================================
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aiohttp
from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from mooncake_vllm.proxy import rewrite
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.errors import (
    BackendFailure,
    FailureKind,
    LegDeadline,
    ProxyError,
    classify,
)
from mooncake_vllm.proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mooncake_vllm.proxy.metrics import ProxyMetrics
from mooncake_vllm.proxy.routing import Backend, BackendPool, Backoff, NoHealthyBackend

logger = logging.getLogger("mooncake_vllm.proxy")

# vLLM's uvicorn closes idle keep-alive connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
# Dropping ours first avoids sending a request on a connection the server is closing, which
# would look like a dead backend.
_KEEPALIVE_S = 4.0
# Connections per backend; more requests than this wait for a free one.
_CONNECTIONS_PER_BACKEND = 1000
# Longest sleep of the prober; a shorter one when a probe is due sooner.
_PROBER_MAX_SLEEP_S = 1.0
# Largest error body read from a backend.
_MAX_ERROR_BODY_BYTES = 64 * 1024


def json_response(body: dict[str, Any], status: int) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json")


# ---- in-flight accounting -----------------------------------------------------------------------


class InFlight:
    """One request outstanding on a backend; ``release()`` is idempotent: call it on any path."""

    def __init__(self, pool: BackendPool, backend: Backend, metrics: ProxyMetrics) -> None:
        self._pool = pool
        self._backend = backend
        self._gauge = metrics.in_flight.labels(pool.role, backend.url)
        self._released = False
        pool.begin(backend)
        self._gauge.set(backend.in_flight)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._pool.end(self._backend)
        self._gauge.set(self._backend.in_flight)

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


# ---- one backend call, with failover ------------------------------------------------------------

# The first backend and at most one other: one failing request adds at most one retry to the
# client's wait, and a second failure in a row is reported instead of tried further.
_ATTEMPTS = 2

T = TypeVar("T")


@dataclass(frozen=True)
class RequestContext:
    """What every leg of one client request needs, passed explicitly from the route handler."""

    request_id: str
    started_s: float  # time.monotonic() at arrival; --timeout-s counts from here
    path: str  # the client's path, which both legs call on their backend
    backend_headers: Mapping[str, str]


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


# ---- the proxy ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Handoff:
    """The prefill leg's outcome."""

    backend_url: str
    kv_transfer_params: dict[str, Any] | None


@dataclass(frozen=True)
class OpenDecode:
    """A decode answer whose status line has arrived; the body is still unread."""

    pool: BackendPool
    backend: Backend
    response: aiohttp.ClientResponse
    in_flight: InFlight
    deadline: LegDeadline


class Proxy:
    """Backend pools, the shared HTTP session, metrics and the prober of one app."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.metrics = ProxyMetrics()
        backoff = Backoff(initial_s=1.0, max_s=30.0)
        self.pools = {
            role: BackendPool(
                role,
                urls,
                cfg.policy,
                backoff=backoff,
                probe_interval_s=cfg.health_interval_s,
            )
            for role, urls in (("prefill", cfg.prefill), ("decode", cfg.decode))
        }
        for role, pool in self.pools.items():
            self.metrics.declare_backends(role, [b.url for b in pool.backends])
        # Read once: the key the backends expect when the client's key is not forwarded.
        self.env_api_key = os.environ.get("OPENAI_API_KEY") or None
        self._session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task[None] | None = None

    # ---- lifecycle (before_serving / after_serving) ---------------------------------------------

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=_CONNECTIONS_PER_BACKEND, keepalive_timeout=_KEEPALIVE_S
        )
        self._session = aiohttp.ClientSession(connector=connector)
        self._prober = asyncio.create_task(self.probe_forever(), name="proxy-health-prober")

    async def stop(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            try:
                await self._prober
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.exception("health prober had failed")
            self._prober = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy is not serving (before_serving has not run)")
        return self._session

    def timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, sock_connect=self.cfg.connect_timeout_s)

    # ---- health ---------------------------------------------------------------------------------

    def healthy(self) -> bool:
        return all(pool.any_healthy() for pool in self.pools.values())

    def health_report(self) -> dict[str, Any]:
        report: dict[str, Any] = {"status": "ok" if self.healthy() else "unavailable"}
        for role, pool in self.pools.items():
            report[role] = pool.snapshot()
        return report

    def eject(self, pool: BackendPool, backend: Backend, reason: str) -> None:
        if pool.eject(backend, reason):
            self.metrics.ejections.labels(pool.role, backend.url).inc()
            logger.warning("%s backend %s ejected: %s", pool.role, backend.url, reason)

    def record_failure(self, pool: BackendPool, backend: Backend, failure: BackendFailure) -> None:
        self.metrics.backend_errors.labels(pool.role, backend.url, failure.kind.value).inc()
        if failure.kind is not FailureKind.TIMEOUT:
            self.eject(pool, backend, failure.message)

    async def probe_forever(self) -> None:
        """Probe due backends, sleep until the next is due; runs until cancelled."""
        while True:
            try:
                due = [(pool, b) for pool in self.pools.values() for b in pool.due_for_probe()]
                results = await asyncio.gather(
                    *(self.probe(pool, b) for pool, b in due), return_exceptions=True
                )
                for (pool, backend), result in zip(due, results, strict=True):
                    if isinstance(result, Exception):
                        # Count it as a failed probe so the backend backs off instead of being
                        # probed again at once.
                        logger.error("probe of %s crashed", backend.url, exc_info=result)
                        pool.probe_failed(backend, f"probe crashed: {result!r}")
                sleep_s = min(p.seconds_until_next_probe() for p in self.pools.values())
            except Exception:
                logger.exception("health probe round failed")
                sleep_s = _PROBER_MAX_SLEEP_S
            await asyncio.sleep(min(max(sleep_s, 0.01), _PROBER_MAX_SLEEP_S))

    async def probe(self, pool: BackendPool, backend: Backend) -> None:
        """One ``GET /health``: 200 means healthy, anything else (or no answer) means not."""
        try:
            async with self.session.get(
                backend.url + "/health",
                timeout=aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s),
            ) as resp:
                status = resp.status
        except asyncio.TimeoutError:
            reason = f"health probe got no answer in {self.cfg.connect_timeout_s:g}s"
            ejected = pool.probe_timed_out(backend, reason)  # a busy backend answers late
        except aiohttp.ClientError as e:
            reason = f"health probe failed: {str(e) or type(e).__name__}"
            ejected = pool.probe_failed(backend, reason)
        else:
            if status == 200:
                if pool.probe_ok(backend):
                    logger.info("%s backend %s is healthy again", pool.role, backend.url)
                return
            reason = f"health probe answered HTTP {status}"
            ejected = pool.probe_failed(backend, reason)
        if ejected:
            self.metrics.ejections.labels(pool.role, backend.url).inc()
            logger.warning("%s backend %s ejected: %s", pool.role, backend.url, reason)
        else:
            logger.info("%s backend %s: %s", pool.role, backend.url, reason)

    def pick(self, pool: BackendPool, tried: list[Backend], last: BackendFailure | None) -> Backend:
        try:
            return pool.pick(exclude=tried)
        except NoHealthyBackend as e:
            if last is not None:  # the pool ran out while failing over: report the real cause
                raise ProxyError.of(502, last.message, "backend_error") from e
            raise ProxyError.of(503, str(e), "service_unavailable") from e

    async def call(
        self,
        pool: BackendPool,
        ctx: RequestContext,
        send: Callable[[Backend, LegDeadline], Awaitable[T]],
        *,
        repeatable: bool,
    ) -> Attempt[T]:
        """``send(backend, deadline)`` to a healthy backend of ``pool``, failing over once.

        A connection that was never opened is retried on another backend: that backend never
        saw the request. One that broke later is retried only when the call is ``repeatable``.
        A missed deadline is never retried (504): the backend may just be busy. Each failure is
        counted, and a connection failure ejects the backend.
        """
        tried: list[Backend] = []
        last: BackendFailure | None = None
        while len(tried) < _ATTEMPTS:
            backend = self.pick(pool, tried, last)
            deadline = LegDeadline.of(self.cfg, ctx.started_s, prefill=pool.role == "prefill")
            in_flight = InFlight(pool, backend, self.metrics)
            try:
                answer = await send(backend, deadline)
            except BaseException as e:  # a cancelled call gives its in-flight count back too
                in_flight.release()
                failure = classify(e, pool.role, backend.url, deadline)
                if failure is None:
                    raise
                self.record_failure(pool, backend, failure)
                if failure.kind is FailureKind.TIMEOUT:
                    raise ProxyError.of(504, failure.message, "timeout") from e
                if failure.kind is not FailureKind.CONNECT and not repeatable:
                    raise ProxyError.of(502, failure.message, "backend_error") from e
                logger.warning("%s %s", ctx.request_id, failure.message)
                tried.append(backend)
                last = failure
                continue
            return Attempt(pool, backend, deadline, in_flight, answer)
        assert last is not None
        raise ProxyError.of(502, last.message, "backend_error")

    async def read_whole(
        self, pool: BackendPool, ctx: RequestContext, method: str, **request: Any
    ) -> Attempt[Reply]:
        """One short, repeatable call to ``ctx.path`` on ``pool``, its answer read whole."""

        async def send(backend: Backend, deadline: LegDeadline) -> Reply:
            sent_s = time.monotonic()
            async with self.session.request(
                method,
                backend.url + ctx.path,
                headers=ctx.backend_headers,
                timeout=self.timeout(deadline.timeout_s),
                **request,
            ) as resp:
                raw = await resp.read()
                content_type = resp.headers.get("Content-Type", "application/json")
                return Reply(resp.status, raw, content_type, time.monotonic() - sent_s)

        attempt = await self.call(pool, ctx, send, repeatable=True)
        attempt.in_flight.release()
        return attempt

    # ---- the prefill leg ------------------------------------------------------------------------

    async def prefill(self, ctx: RequestContext, body: dict[str, Any]) -> Handoff:
        """Run the prefill leg; returns the handoff for the decode or raises ProxyError.

        The prefill leg is safe to repeat (it only fills a cache and returns one token), so a
        connection failure is retried once on another healthy prefill; an HTTP error is not.
        """
        leg_body = rewrite.build_prefill_body(body, ctx.path, rewrite.new_transfer_id())
        attempt = await self.read_whole(self.pools["prefill"], ctx, "POST", json=leg_body)
        backend, reply = attempt.backend, attempt.answer
        self.metrics.prefill_seconds.labels(backend.url).observe(reply.took_s)
        logger.info("%s prefill %s -> %d", ctx.request_id, backend.url, reply.status)
        return self._handoff(ctx, attempt)

    def _handoff(self, ctx: RequestContext, attempt: Attempt[Reply]) -> Handoff:
        pool, backend, reply = attempt.pool, attempt.backend, attempt.answer
        if not 200 <= reply.status < 300:
            if reply.status >= 500:
                self.metrics.backend_errors.labels(pool.role, backend.url, "http_5xx").inc()
            raise ProxyError(
                reply.status, rewrite.backend_error_body("prefill", reply.status, reply.body)
            )
        try:
            answer = json.loads(reply.body)
        except (UnicodeDecodeError, ValueError) as e:
            self.metrics.backend_errors.labels(pool.role, backend.url, "bad_answer").inc()
            raise ProxyError.of(
                502, f"prefill backend {backend.url} answered with non-JSON", "backend_error"
            ) from e
        params = rewrite.handoff_from_prefill(answer)
        if params is None:
            self.metrics.missing_handoff.labels(backend.url).inc()
            logger.warning(
                "%s prefill %s returned no kv_transfer_params (is the KV connector configured "
                "as producer?); the decode will compute the prompt itself",
                ctx.request_id,
                backend.url,
            )
        return Handoff(backend.url, params)

    # ---- the decode leg -------------------------------------------------------------------------

    async def open_decode(self, ctx: RequestContext, body: dict[str, Any]) -> OpenDecode:
        """Send the decode leg and wait for its status line; the caller owns the result.

        Only a connection that was never opened is retried on another decode: once the decode
        has the request it may already be pulling the KV, and a transfer id is used once.
        """

        async def send(backend: Backend, deadline: LegDeadline) -> aiohttp.ClientResponse:
            return await self.session.post(
                backend.url + ctx.path,
                json=body,
                headers=ctx.backend_headers,
                timeout=self.timeout(deadline.timeout_s),
            )

        attempt = await self.call(self.pools["decode"], ctx, send, repeatable=False)
        resp = attempt.answer
        logger.info("%s decode %s -> %d", ctx.request_id, attempt.backend.url, resp.status)
        return OpenDecode(attempt.pool, attempt.backend, resp, attempt.in_flight, attempt.deadline)

    async def read_decode(self, leg: OpenDecode) -> bytes:
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
            self.record_failure(leg.pool, leg.backend, failure)
            status = 504 if failure.kind is FailureKind.TIMEOUT else 502
            raise ProxyError.of(status, failure.message, failure.kind.value) from e
        finally:
            # release() keeps a fully read connection for reuse and closes any other.
            leg.response.release()
            leg.in_flight.release()
        return raw

    # ---- one client request ---------------------------------------------------------------------

    async def generate(self, ctx: RequestContext, body: dict[str, Any]) -> Response:
        handoff = await self.prefill(ctx, body)
        decode_body = rewrite.build_decode_body(body, handoff.kv_transfer_params)
        leg = await self.open_decode(ctx, decode_body)
        status = leg.response.status
        if not 200 <= status < 300:
            raw = await self.read_decode(leg)
            if status >= 500:
                self.metrics.backend_errors.labels("decode", leg.backend.url, "http_5xx").inc()
            raise ProxyError(status, rewrite.backend_error_body("decode", status, raw))
        if not rewrite.wants_stream(body):
            raw = await self.read_decode(leg)
            self.metrics.first_decode_byte_seconds.observe(time.monotonic() - ctx.started_s)
            content_type = leg.response.headers.get("Content-Type", "application/json")
            return Response(raw, status=status, content_type=content_type)
        stream = DecodeStream(self, leg, ctx)
        response = Response(stream, status=status, mimetype="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        return response

    async def models(self, ctx: RequestContext) -> Response:
        """``GET /v1/models`` from a healthy decode (any decode serves the same model)."""
        reply = (await self.read_whole(self.pools["decode"], ctx, "GET")).answer
        if not 200 <= reply.status < 300:
            raise ProxyError(
                reply.status, rewrite.backend_error_body("decode", reply.status, reply.body)
            )
        return Response(reply.body, status=reply.status, content_type=reply.content_type)


def _abandon(response: aiohttp.ClientResponse, in_flight: InFlight) -> None:
    # close(), not release(): the connection must drop so vLLM notices and aborts the request.
    response.close()
    in_flight.release()


class DecodeStream:
    """The body of a streamed answer: the decode's SSE bytes, passed on as they arrive.

    Quart iterates it and calls ``aclose()`` when the response ends or the client disconnects
    (the handler task is cancelled). If the response is dropped before Quart starts iterating,
    the finalizer still closes the decode connection and releases the in-flight count.
    """

    def __init__(self, proxy: Proxy, leg: OpenDecode, ctx: RequestContext) -> None:
        self._proxy = proxy
        self._leg = leg
        self._started_s = ctx.started_s
        self._request_id = ctx.request_id
        self._first_byte_seen = False
        self._at_event_boundary = True
        self._finished = False
        self._close = weakref.finalize(self, _abandon, leg.response, leg.in_flight)

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
            self._proxy.record_failure(leg.pool, leg.backend, failure)
            logger.warning("%s stream cut: %s", self._request_id, failure.message)
            self._finish(clean=False)
            separator = b"" if self._at_event_boundary else b"\n\n"
            return separator + rewrite.sse_error_event(failure.message, failure.kind.value)
        if not chunk:
            self._finish(clean=True)
            raise StopAsyncIteration
        if not self._first_byte_seen:
            self._first_byte_seen = True
            self._proxy.metrics.first_decode_byte_seconds.observe(
                time.monotonic() - self._started_s
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
                "%s client went away mid-stream; closing the decode stream", self._request_id
            )
            self._finished = True
        self._close()


# ---- the app ------------------------------------------------------------------------------------


def create_app(cfg: ProxyConfig) -> Quart:
    app = Quart("mooncake_vllm.proxy")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.config["BODY_TIMEOUT"] = cfg.timeout_s
    # The decode leg carries the --timeout-s deadline and a stream that misses it ends with an
    # error event (see DecodeStream); Quart's own response timeout would cut it silently.
    app.config["RESPONSE_TIMEOUT"] = None
    proxy = Proxy(cfg)

    @app.before_serving
    async def _start() -> None:
        await proxy.start()

    @app.after_serving
    async def _stop() -> None:
        await proxy.stop()

    @app.before_request
    async def _begin_request() -> Response | None:
        g.started_s = time.monotonic()
        g.request_id = rewrite.request_id_from(request.headers.get("X-Request-Id"))
        if cfg.api_key is not None and request.path.startswith("/v1/"):
            expected = f"Bearer {cfg.api_key}".encode()
            sent = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(sent, expected):
                body = rewrite.openai_error(
                    "missing or wrong API key; send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    code="invalid_api_key",
                )
                return json_response(body, 401)
        return None

    @app.after_request
    async def _finish_request(response: Response) -> Response:
        request_id = getattr(g, "request_id", None)
        if request_id is not None:
            response.headers["X-Request-Id"] = request_id
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        proxy.metrics.requests.labels(rule, str(response.status_code)).inc()
        return response

    @app.errorhandler(ProxyError)
    async def _proxy_error(e: ProxyError) -> Response:
        logger.info("%s -> %d: %s", g.request_id, e.status, e)
        return json_response(e.body, e.status)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException) -> Response:
        status = e.code or 500
        if isinstance(e, RequestEntityTooLarge):
            message = f"request body is larger than {cfg.max_body_bytes} bytes (--max-body-bytes)"
        else:
            message = f"{e.name}: {e.description}" if e.description else e.name
        error_type = "invalid_request_error" if status < 500 else "internal_error"
        return json_response(rewrite.openai_error(message, error_type), status)

    @app.errorhandler(Exception)
    async def _unexpected(e: Exception) -> Response:
        logger.exception("%s failed", getattr(g, "request_id", "-"))
        message = f"internal proxy error: {type(e).__name__}"
        return json_response(rewrite.openai_error(message, "internal_error"), 500)

    def request_context() -> RequestContext:
        headers = rewrite.backend_headers(
            request_id=g.request_id,
            client_authorization=request.headers.get("Authorization"),
            forward_client_authorization=cfg.api_key is None,
            env_api_key=proxy.env_api_key,
        )
        return RequestContext(g.request_id, g.started_s, request.path, headers)

    async def generation() -> Response:
        raw = await request.get_data(cache=False)
        try:
            body = rewrite.parse_body(raw)
            rewrite.validate_body(body, request.path)
        except rewrite.InvalidRequest as e:
            raise ProxyError.of(400, e.message, "invalid_request_error", e.param) from e
        return await proxy.generate(request_context(), body)

    app.add_url_rule(rewrite.COMPLETIONS_PATH, "completions", generation, methods=["POST"])
    app.add_url_rule(
        rewrite.CHAT_COMPLETIONS_PATH, "chat_completions", generation, methods=["POST"]
    )

    @app.get("/v1/models")
    async def _models() -> Response:
        return await proxy.models(request_context())

    @app.get("/health")
    async def _health() -> Response:
        return json_response(proxy.health_report(), 200 if proxy.healthy() else 503)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(proxy.metrics.render(), status=200, content_type=METRICS_CONTENT_TYPE)

    return app
