"""The proxy's Quart app: for each request, a prefill leg, then a decode leg streamed back.

Where to look:

- ``legs.prefill`` / ``legs.open_decode``: the two legs, and what each may retry;
- ``failover.Backends.call``: backend choice, deadline, in-flight count, failover (both legs);
- ``errors``: the errors a client can get, and what a failed backend call means;
- ``stream.DecodeStream``: streaming the decode's answer, and when either side goes away;
- ``health.HealthProber``: the background health prober;
- ``create_app`` (here): the routes, auth, per-client limits (``limits``), and the error
  handlers that keep every answer OpenAI-shaped.

Failures and what the client sees:

======================================  =====================================================
prefill or decode answers 4xx/5xx       that status, with the backend's error body
a backend refuses/resets the connection the backend is ejected; 502 (the prefill leg is retried
                                        once on another prefill first, the decode leg only
                                        when the connection was never opened)
no prefill takes the leg (none up, all  the decode gets a plain request and computes the
draining or dropping it)                prompt itself (``dispatched_total{how="local"}``)
a decode's KV load failed before a      both legs are sent again, once (``how="reloaded"``)
token (its prefill went away)
no healthy decode                       503 naming the pool
prefill or decode misses its deadline   504 naming the deadline and its flag
decode fails mid-stream                 a final ``data: {"error": ...}`` event, then the end
client goes away mid-stream             the decode connection is closed, so vLLM aborts
no or a wrong API key (``--api-key*``)  401 (also on /metrics, /health with ``--protect-*``)
over a ``--client-*`` limit             429 with ``Retry-After``; no backend sees the request
======================================  =====================================================
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from typing import Any

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from mooncake_vllm.proxy import concurrent, fanout, legs, prompt_list, rewrite
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.discovery import RegistryFollower
from mooncake_vllm.proxy.errors import LoadFailed, ProxyError
from mooncake_vllm.proxy.failover import Backends, RequestContext, with_route_keys
from mooncake_vllm.proxy.health import HealthProber, health_report, healthy
from mooncake_vllm.proxy.kv_events import KvEventSubscriber
from mooncake_vllm.proxy.limits import ClientLimits, Refusal
from mooncake_vllm.proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mooncake_vllm.proxy.metrics import ProxyMetrics
from mooncake_vllm.proxy.stream import DecodeStream

logger = logging.getLogger("mooncake_vllm.proxy")


def json_response(
    body: dict[str, Any], status: int, headers: dict[str, str] | None = None
) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


# ---- one client request -------------------------------------------------------------------------


async def generate(
    backends: Backends, ctx: RequestContext, body: dict[str, Any], raw: bytes
) -> Response:
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
    try:
        leg = await _both_legs(backends, ctx, body, raw, resendable=True)
    except LoadFailed as e:
        # The prefill that held the KV went away before the decode pulled it (a crash, or a
        # drain past its --shutdown-timeout): nothing reached the client, so both legs go
        # again, once; with no prefill left the decode computes the prompt itself.
        backends.metrics.dispatched.labels("reloaded").inc()
        logger.warning("%s %s; the request is sent again", ctx.request_id, e)
        leg = await _both_legs(backends, ctx, body, raw, resendable=False)
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
) -> Response:
    """The client's answer from an open decode leg: read whole, or streamed."""
    if not rewrite.wants_stream(body):
        raw = await legs.read_decode(backends, leg)
        backends.metrics.first_decode_byte_seconds.observe(time.monotonic() - ctx.started_s)
        content_type = leg.response.headers.get("Content-Type", "application/json")
        return Response(raw, status=leg.response.status, content_type=content_type)
    stream = DecodeStream(backends, leg, ctx)
    response = Response(stream, status=leg.response.status, mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    return response


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
    app.config["BODY_TIMEOUT"] = cfg.timeout_s
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
        KvEventSubscriber(backends.cache, cfg.kv_event_endpoints())
        if backends.cache is not None
        else None
    )
    app.extensions["kv_events"] = subscriber  # tests and /health read what it heard
    # Read once: the key the backends expect when the client's key is not forwarded.
    env_api_key = os.environ.get("OPENAI_API_KEY") or None
    # "Bearer <key>" -> the client it names in --client-* limits (never the key itself).
    client_keys = {f"Bearer {k}".encode(): f"api-key-{i + 1}" for i, k in enumerate(cfg.api_keys())}
    protected_paths = {p for p, on in (("/metrics", cfg.protect_metrics),
                                       ("/health", cfg.protect_health)) if on}  # fmt: skip
    limits = None
    if cfg.client_max_concurrency is not None or cfg.client_rate is not None:
        limits = ClientLimits(
            max_concurrency=cfg.client_max_concurrency,
            rate_per_s=cfg.client_rate,
            burst=cfg.client_burst,
        )
    app.extensions["client_limits"] = limits

    @app.before_serving
    async def _start() -> None:
        await backends.open()
        prober.start()
        if follower is not None:
            follower.start()
        if subscriber is not None:
            subscriber.start()

    @app.after_serving
    async def _stop() -> None:
        if subscriber is not None:
            await subscriber.stop()
        if follower is not None:
            await follower.stop()
        await prober.stop()  # before the session it probes with closes
        await backends.close()

    @app.before_request
    async def _begin_request() -> Response | None:
        g.started_s = time.monotonic()
        g.request_id = rewrite.request_id_from(request.headers.get("X-Request-Id"))
        g.client_slot = None
        api = request.path.startswith("/v1/")
        client = None
        if client_keys and (api or request.path in protected_paths):
            client = _authenticated_client(client_keys)
            if client is None:
                return _unauthorized()
        if limits is not None and api:
            # A key the proxy did not check is no identity: a client could send a new one with
            # every request. Then the client is its address.
            admitted = limits.acquire(client or f"address {request.remote_addr}")
            if isinstance(admitted, Refusal):
                metrics.client_limited.labels(admitted.reason).inc()
                return _too_many_requests(admitted)
            g.client_slot = admitted
        return None

    @app.teardown_request
    async def _end_request(_: BaseException | None) -> None:
        # Runs before a streamed body is sent: a DecodeStream has taken its slot over by then.
        slot = getattr(g, "client_slot", None)
        if slot is not None:
            slot.release_unless_handed_over()

    @app.after_request
    async def _finish_request(response: Response) -> Response:
        request_id = getattr(g, "request_id", None)
        if request_id is not None:
            response.headers["X-Request-Id"] = request_id
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        metrics.requests.labels(rule, str(response.status_code)).inc()
        return response

    _handle_errors(app, cfg)

    def request_context() -> RequestContext:
        def headers(backend_trusted: bool) -> dict[str, str]:
            return rewrite.backend_headers(
                request_id=g.request_id,
                client_authorization=request.headers.get("Authorization"),
                forward_client_authorization=not client_keys,
                env_api_key=env_api_key,
                backend_trusted=backend_trusted,
            )

        return RequestContext(
            g.request_id,
            g.started_s,
            request.path,
            trusted_headers=headers(True),
            untrusted_headers=headers(False),
            client_slot=g.client_slot,
        )

    async def generation() -> Response:
        raw = await request.get_data(cache=False)
        try:
            body = rewrite.parse_body(raw)
            rewrite.validate_body(body, request.path)
        except rewrite.InvalidRequest as e:
            raise ProxyError.of(400, e.message, "invalid_request_error", e.param) from e
        # vLLM names its answer after X-Request-Id, else the body's request_id; the proxy sends
        # X-Request-Id on both legs, so it takes the body's when the client sent no header.
        body_request_id = body.get("request_id")
        if request.headers.get("X-Request-Id") is None and isinstance(body_request_id, str):
            g.request_id = rewrite.request_id_from(body_request_id)
        ctx = request_context()
        ctx = with_route_keys(ctx, body, cfg.policy)
        return await generate(backends, ctx, body, raw)

    app.add_url_rule(rewrite.COMPLETIONS_PATH, "completions", generation, methods=["POST"])
    app.add_url_rule(
        rewrite.CHAT_COMPLETIONS_PATH, "chat_completions", generation, methods=["POST"]
    )

    @app.get("/v1/models")
    async def _models() -> Response:
        return await models(backends, request_context())

    @app.get("/health")
    async def _health() -> Response:
        return json_response(health_report(backends), 200 if healthy(backends) else 503)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(metrics.render(), status=200, content_type=METRICS_CONTENT_TYPE)

    return app


def _authenticated_client(client_keys: dict[bytes, str]) -> str | None:
    """The client named by the request's ``Authorization: Bearer <key>``; None for no or a wrong
    key. Every key is compared, in constant time each."""
    sent = request.headers.get("Authorization", "").encode()
    client = None
    for expected, name in client_keys.items():
        if hmac.compare_digest(sent, expected):
            client = name
    return client


def _unauthorized() -> Response:
    body = rewrite.openai_error(
        "missing or wrong API key; send 'Authorization: Bearer <key>'",
        "authentication_error",
        code="invalid_api_key",
    )
    return json_response(body, 401, {"WWW-Authenticate": "Bearer"})


def _too_many_requests(refusal: Refusal) -> Response:
    code = "rate_limit_exceeded" if refusal.reason == "rate" else "concurrency_limit_exceeded"
    body = rewrite.openai_error(refusal.message, "rate_limit_error", code=code)
    return json_response(body, 429, {"Retry-After": refusal.retry_after_header})


def _handle_errors(app: Quart, cfg: ProxyConfig) -> None:
    """Every error answer is an OpenAI error body, whatever raised it."""

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
