"""The proxy's Quart app: for each request, a prefill leg, then a decode leg streamed back.

Where to look:

- ``legs.prefill`` / ``legs.open_decode``: the two legs, and what each may retry;
- ``failover.Backends.call``: backend choice, deadline, in-flight count, failover (both legs);
- ``errors``: the errors a client can get, and what a failed backend call means;
- ``stream.DecodeStream``: streaming the decode's answer, and when either side goes away;
- ``health.HealthProber``: the background health prober;
- ``create_app`` (here): the routes, the per-request ``Gate`` (auth, per-client limits
  (``limits``), request ids), and the error handlers that keep every answer OpenAI-shaped;
- ``asgi.GenerationDoor``: the two generation paths, served without Quart's per-request
  machinery (the proxy's hot path); every other route is Quart's.

Failures and what the client sees:

======================================  =====================================================
prefill or decode answers 4xx/5xx       that status, with the backend's error body
a backend refuses/resets the connection the backend is ejected; 502 (the prefill leg is retried
                                        once on another prefill first, the decode leg only
                                        when the connection was never opened)
no prefill takes the leg (none up, all  the decode gets a plain request and computes the
draining or dropping it)                prompt itself (``dispatched_total{how="local"}``)
a decode's KV load failed before a      both legs are sent again, up to 3 times (``how="reloaded"``)
token (its prefill went away)
no healthy decode                       503 naming the pool
prefill or decode misses its deadline   504 naming the deadline and its flag
decode fails mid-stream                 a final ``data: {"error": ...}`` event, then the end
client goes away mid-stream             the decode connection is closed, so vLLM aborts
no or a wrong API key (``--api-key*``)  401 (also on /metrics, /health with ``--protect-*``)
over a ``--client-*`` limit             429 with ``Retry-After``; no backend sees the request
a head too large or too slow            431 or 408, the connection closed (``http_head``)
a body too large or too slow            413 (``--max-body-bytes``) or 408 (``--body-timeout-s``)
client leaves before its body is whole  logged at INFO, counted as 499; nothing answered
too many prompts, JSON nested too deep  400 naming ``--max-prompts`` / the nesting
======================================  =====================================================
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import time
from typing import Any

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from mooncake_vllm.core import tracing
from mooncake_vllm.proxy import concurrent, fanout, legs, prompt_list, rewrite
from mooncake_vllm.proxy.asgi import Admitted, Answer, GenerationDoor, Incoming, http_error_answer
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.discovery import RegistryFollower
from mooncake_vllm.proxy.errors import LoadFailed, ProxyError
from mooncake_vllm.proxy.failover import Backends, RequestContext, with_route_keys
from mooncake_vllm.proxy.health import HealthProber, health_report, healthy, stop_task
from mooncake_vllm.proxy.kv_events import KvEventSubscriber
from mooncake_vllm.proxy.limits import ClientLimits, Refusal
from mooncake_vllm.proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mooncake_vllm.proxy.metrics import ProxyMetrics
from mooncake_vllm.proxy.routing import Policy
from mooncake_vllm.proxy.stream import DecodeStream

logger = logging.getLogger("mooncake_vllm.proxy")


def json_response(
    body: dict[str, Any], status: int, headers: dict[str, str] | None = None
) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


def quart_response(answer: Answer) -> Response:
    """An ``Answer`` with a whole body, for a Quart route."""
    assert isinstance(answer.body, bytes)
    headers = {k.decode(): v.decode() for k, v in answer.headers}
    content_type = answer.content_type.decode()
    return Response(answer.body, status=answer.status, content_type=content_type, headers=headers)


# ---- one client request -------------------------------------------------------------------------


# How many times a request whose decode failed to load its KV is sent again (``generate``).
MAX_RELOADS = 3


async def generate(
    backends: Backends, ctx: RequestContext, body: dict[str, Any], raw: bytes
) -> Answer:
    """A completion (``body`` parsed from the client's ``raw`` bytes): the prefill leg, then the
    decode's answer, read whole or streamed.

    A list of prompts gets a prefill leg and a decode request per prompt (``fanout``); a
    request whose decode would read no KV by transfer goes to the decode alone
    (``rewrite.served_by_decode_alone``). Pool mode needs neither split: a prefill leg with
    the whole list puts every prompt in the pool, where the decode finds it.
    """
    alone = rewrite.served_by_decode_alone(body, ctx.path)
    if alone is not None:
        logger.info("%s: %s: the decode serves it alone", ctx.request_id, alone)
        decode_body = rewrite.decode_body_bytes(raw, body, None)
        leg = await legs.open_decode_ok(backends, ctx, decode_body)
        return await respond(backends, ctx, body, leg)
    if backends.cfg.mode != "pool" and (prompts := prompt_list.prompts_to_split(body)):
        return await fanout.generate_each_prompt(backends, ctx, body, prompts)
    # The decode's KV load failed before its first token: the prefill that held the KV went
    # away (a crash, or a drain past its --shutdown-timeout), or the request waited in the
    # decode's queue past the lease (lease_ttl_s) under pressure. Nothing reached the client, so
    # both legs go again, up to MAX_RELOADS times within --timeout-s; with no prefill left the
    # decode computes the prompt itself. A re-sent request queues again, so under sustained
    # pressure its lease can expire again too (seen: twice in a row for one request).
    reloads = 0
    while True:
        try:
            leg = await _both_legs(backends, ctx, body, raw, resendable=reloads < MAX_RELOADS)
            break
        except LoadFailed as e:
            reloads += 1
            backends.metrics.dispatched.labels("reloaded").inc()
            logger.warning(
                "%s %s; the request is sent again (%d of %d)", ctx.request_id, e, reloads,
                MAX_RELOADS,
            )  # fmt: skip
    return await respond(backends, ctx, body, leg)


async def _both_legs(
    backends: Backends, ctx: RequestContext, body: dict[str, Any], raw: bytes, *, resendable: bool
) -> legs.OpenDecode:
    """The prefill leg and the decode leg of one prompt; the decode's answer opened up to its
    first token. ``resendable``: see ``legs.open_decode_ok``."""
    if backends.cfg.dispatch == "concurrent":
        return await concurrent.open_both(backends, ctx, body, raw, resendable=resendable)
    outcome = await legs.prefill(backends, ctx, body)
    decode_body = rewrite.decode_body_bytes(raw, body, outcome.kv_transfer_params)
    resendable = resendable and outcome.kv_transfer_params is not None
    return await legs.open_decode_ok(backends, ctx, decode_body, resendable=resendable)


async def respond(
    backends: Backends, ctx: RequestContext, body: dict[str, Any], leg: legs.OpenDecode
) -> Answer:
    """The client's answer from an open decode leg: read whole, or streamed."""
    if not rewrite.wants_stream(body):
        raw = await legs.read_decode(backends, leg)
        backends.metrics.first_decode_byte_seconds.observe(time.monotonic() - ctx.started_s)
        content_type = leg.response.headers.get("content-type", "application/json")
        return Answer(leg.response.status, raw, content_type.encode("latin-1"))
    return Answer.event_stream(leg.response.status, DecodeStream(backends, leg, ctx))


async def models(backends: Backends, ctx: RequestContext) -> Response:
    """``GET /v1/models`` from a healthy decode (any decode serves the same model)."""
    reply = (await backends.read_whole("decode", ctx, "GET")).answer
    if not 200 <= reply.status < 300:
        raise ProxyError(
            reply.status, rewrite.backend_error_body("decode", reply.status, reply.body)
        )
    return Response(reply.body, status=reply.status, content_type=reply.content_type)


# ---- the app ------------------------------------------------------------------------------------


def create_app(cfg: ProxyConfig) -> Quart:
    app = Quart("mooncake_vllm.proxy")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.config["BODY_TIMEOUT"] = cfg.body_timeout_s
    # The decode leg carries the --timeout-s deadline and a stream that misses it ends with an
    # error event (see DecodeStream); Quart's own response timeout would cut it silently.
    app.config["RESPONSE_TIMEOUT"] = None
    metrics = ProxyMetrics()
    backends = Backends(cfg, metrics)
    prober = HealthProber(backends)
    follower = (
        RegistryFollower(
            backends,
            cfg.discover,
            cfg.discover_interval_s,
            cfg.auth_keys(),
            cfg.metadata_auth(),
            grace_s=cfg.discover_grace_s,
        )
        if cfg.discover
        else None
    )
    app.extensions["registry_follower"] = follower  # tests wait on its rounds
    subscriber = (
        KvEventSubscriber(backends.cache, cfg.kv_event_endpoints(), metrics)
        if backends.cache is not None
        else None
    )
    app.extensions["kv_events"] = subscriber  # tests and /health read what it heard
    gate = Gate(cfg, metrics)
    app.extensions["client_limits"] = gate.limits

    # --policy kv: text and chat prompts tokenized as vLLM does (``proxy.tokens``), once loaded.
    app.extensions["tokenizer"] = None
    loader: list[asyncio.Task] = []

    async def _load_tokenizer() -> None:
        from mooncake_vllm.proxy.tokens import find_tokenizer

        def urls() -> list[str]:
            return [b.url for pool in backends.pools.values() for b in pool.backends]

        app.extensions["tokenizer"] = await find_tokenizer(cfg.tokenizer, urls)

    @app.before_serving
    async def _start() -> None:
        if cfg.policy is Policy.KV:
            loader.append(asyncio.create_task(_load_tokenizer()))
        await backends.open()
        prober.start()
        if follower is not None:
            follower.start()
        if subscriber is not None:
            subscriber.start()

    @app.after_serving
    async def _stop() -> None:
        for task in loader:
            await stop_task(task, "the tokenizer loader")
        if subscriber is not None:
            await subscriber.stop()
        if follower is not None:
            await follower.stop()
        await prober.stop()  # before the session it probes with closes
        await backends.close()
        if backends.tracer is not None:
            await asyncio.to_thread(tracing.shutdown)  # the last spans out

    # The routes Quart serves (all but the generation paths, which ``GenerationDoor`` serves)
    # pass the same gate and are counted the same way.

    @app.before_request
    async def _begin_request() -> Response | None:
        g.admitted = admitted = gate.admit(
            request.path,
            request.headers.get("Authorization"),
            request.headers.get("X-Request-Id"),
            request.remote_addr,
        )
        return quart_response(admitted.refusal) if admitted.refusal is not None else None

    @app.teardown_request
    async def _end_request(_: BaseException | None) -> None:
        admitted = getattr(g, "admitted", None)
        if admitted is not None and admitted.client_slot is not None:
            admitted.client_slot.release_unless_handed_over()

    @app.after_request
    async def _finish_request(response: Response) -> Response:
        admitted = getattr(g, "admitted", None)
        if admitted is not None:
            response.headers["X-Request-Id"] = admitted.request_id
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        gate.count(rule, response.status_code)
        return response

    _handle_errors(app, cfg)

    async def generation(incoming: Incoming, admitted: Admitted) -> Answer:
        try:
            body = rewrite.parse_body(incoming.body)
            rewrite.validate_body(body, incoming.path)
            prompt_list.check_prompt_count(body, cfg.max_prompts)
        except rewrite.InvalidRequest as e:
            raise ProxyError.of(400, e.message, "invalid_request_error", e.param) from e
        except RecursionError as e:  # msgspec's decoder recurses per level ("[[[[...")
            message = "request body is nested too deeply to parse: send a flatter JSON object"
            raise ProxyError.of(400, message, "invalid_request_error") from e
        # vLLM names its answer after X-Request-Id, else the body's request_id; the proxy sends
        # X-Request-Id on both legs, so it takes the body's when the client sent no header.
        body_request_id = body.get("request_id")
        if incoming.request_id_header is None and isinstance(body_request_id, str):
            admitted.request_id = rewrite.request_id_from(body_request_id)
        ctx = gate.request_context(admitted, incoming.path, incoming.authorization)
        if incoming.trace_parent:
            ctx = dataclasses.replace(ctx, trace_parent=incoming.trace_parent)
        ctx = with_route_keys(ctx, body, cfg.policy)
        tokenizer = app.extensions["tokenizer"]
        if tokenizer is not None and ctx.prompt_token_ids is None:
            ids = await asyncio.to_thread(tokenizer.token_ids, body, incoming.path)
            if ids:
                ctx = dataclasses.replace(ctx, prompt_token_ids=ids)
        return await generate(backends, ctx, body, incoming.body)

    @app.get("/v1/models")
    async def _models() -> Response:
        ctx = gate.request_context(g.admitted, request.path, request.headers.get("Authorization"))
        return await models(backends, ctx)

    @app.get("/health")
    async def _health() -> Response:
        report = health_report(backends)
        if cfg.policy is Policy.KV:  # which tokenizer text and chat prompts route by, if any
            tokenizer = app.extensions["tokenizer"]
            report["tokenizer"] = tokenizer.source if tokenizer is not None else None
        return json_response(report, 200 if healthy(backends) else 503)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(metrics.render(), status=200, content_type=METRICS_CONTENT_TYPE)

    app.asgi_app = GenerationDoor(  # type: ignore[method-assign]
        app.asgi_app,
        gate,
        generation,
        max_body_bytes=cfg.max_body_bytes,
        body_timeout_s=cfg.body_timeout_s,
        tracer=backends.tracer,
    )
    return app


class Gate:
    """What every client request passes before it is served, and how its answer is counted: the
    API key (``--api-key*``, ``--protect-*``), the ``--client-*`` limits, its request id and the
    headers its backend calls carry. Quart's hooks and ``GenerationDoor`` both use it."""

    def __init__(self, cfg: ProxyConfig, metrics: ProxyMetrics) -> None:
        self._metrics = metrics
        # Read once: the key the backends expect when the client's key is not forwarded.
        self._env_api_key = os.environ.get("OPENAI_API_KEY") or None
        # "Bearer <key>" -> the client it names in --client-* limits (never the key itself).
        self._client_keys = {
            f"Bearer {k}".encode(): f"api-key-{i + 1}" for i, k in enumerate(cfg.api_keys())
        }
        protect = (("/metrics", cfg.protect_metrics), ("/health", cfg.protect_health))
        self._protected_paths = {path for path, on in protect if on}
        self.limits = None
        if cfg.client_max_concurrency is not None or cfg.client_rate is not None:
            self.limits = ClientLimits(
                max_concurrency=cfg.client_max_concurrency,
                rate_per_s=cfg.client_rate,
                burst=cfg.client_burst,
            )
        # (endpoint, status) -> its mooncake_proxy_requests_total child: labels() per request
        # showed up in profiles.
        self._counters: dict[tuple[str, int], Any] = {}

    def admit(
        self,
        path: str,
        authorization: str | None,
        request_id: str | None,
        remote_addr: str | None,
    ) -> Admitted:
        """A request arriving now, with its request id; its ``refusal`` is set for no or a
        wrong API key (401) and over a ``--client-*`` limit (429)."""
        admitted = Admitted(rewrite.request_id_from(request_id), time.monotonic())
        api = path.startswith("/v1/")
        client = None
        if self._client_keys and (api or path in self._protected_paths):
            client = _authenticated_client(self._client_keys, authorization)
            if client is None:
                admitted.refusal = _unauthorized()
                return admitted
        if self.limits is not None and api:
            # A key the proxy did not check is no identity: a client could send a new one with
            # every request. Then the client is its address.
            slot = self.limits.acquire(client or f"address {remote_addr}")
            if isinstance(slot, Refusal):
                self._metrics.client_limited.labels(slot.reason).inc()
                admitted.refusal = _too_many_requests(slot)
                return admitted
            admitted.client_slot = slot
        return admitted

    def count(self, endpoint: str, status: int) -> None:
        """Count an answer in ``mooncake_proxy_requests_total``."""
        counter = self._counters.get((endpoint, status))
        if counter is None:
            counter = self._metrics.requests.labels(endpoint, str(status))
            self._counters[endpoint, status] = counter
        counter.inc()

    def request_context(
        self, admitted: Admitted, path: str, client_authorization: str | None
    ) -> RequestContext:
        def headers(backend_trusted: bool) -> dict[str, str]:
            return rewrite.backend_headers(
                request_id=admitted.request_id,
                client_authorization=client_authorization,
                forward_client_authorization=not self._client_keys,
                env_api_key=self._env_api_key,
                backend_trusted=backend_trusted,
            )

        return RequestContext(
            admitted.request_id,
            admitted.started_s,
            path,
            trusted_headers=headers(True),
            untrusted_headers=headers(False),
            client_slot=admitted.client_slot,
        )


def _authenticated_client(client_keys: dict[bytes, str], authorization: str | None) -> str | None:
    """The client named by the request's ``Authorization: Bearer <key>``; None for no or a wrong
    key. Every key is compared, in constant time each."""
    sent = (authorization or "").encode()
    client = None
    for expected, name in client_keys.items():
        if hmac.compare_digest(sent, expected):
            client = name
    return client


def _unauthorized() -> Answer:
    body = rewrite.openai_error(
        "missing or wrong API key; send 'Authorization: Bearer <key>'",
        "authentication_error",
        code="invalid_api_key",
    )
    return Answer.json(401, body, ((b"www-authenticate", b"Bearer"),))


def _too_many_requests(refusal: Refusal) -> Answer:
    code = "rate_limit_exceeded" if refusal.reason == "rate" else "concurrency_limit_exceeded"
    body = rewrite.openai_error(refusal.message, "rate_limit_error", code=code)
    return Answer.json(429, body, ((b"retry-after", refusal.retry_after_header.encode()),))


def _handle_errors(app: Quart, cfg: ProxyConfig) -> None:
    """Every error answer is an OpenAI error body, whatever raised it."""

    @app.errorhandler(ProxyError)
    async def _proxy_error(e: ProxyError) -> Response:
        logger.info("%s -> %d: %s", g.admitted.request_id, e.status, e)
        return json_response(e.body, e.status)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException) -> Response:
        return quart_response(http_error_answer(e, cfg.max_body_bytes))

    @app.errorhandler(Exception)
    async def _unexpected(e: Exception) -> Response:
        admitted = getattr(g, "admitted", None)
        logger.exception("%s failed", admitted.request_id if admitted is not None else "-")
        message = f"internal proxy error: {type(e).__name__}"
        return json_response(rewrite.openai_error(message, "internal_error"), 500)
