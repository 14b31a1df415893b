"""The proxy's Quart app: for each request, a prefill leg, then a decode leg streamed back.

Where to look:

- ``legs.prefill`` / ``legs.open_decode``: the two legs, and what each may retry;
- ``failover.Backends.call``: backend choice, deadline, in-flight count, failover (both legs);
- ``errors``: the errors a client can get, and what a failed backend call means;
- ``stream.DecodeStream``: streaming the decode's answer, and when either side goes away;
- ``health.HealthProber``: the background health prober;
- ``create_app`` (here): the routes, auth, and the error handlers that keep every answer
  OpenAI-shaped.

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

import dataclasses
import hmac
import json
import logging
import os
import time
from typing import Any

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from mooncake_vllm.proxy import legs, rewrite
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.discovery import RegistryFollower
from mooncake_vllm.proxy.errors import ProxyError
from mooncake_vllm.proxy.failover import Backends, RequestContext
from mooncake_vllm.proxy.health import HealthProber, health_report, healthy
from mooncake_vllm.proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mooncake_vllm.proxy.metrics import ProxyMetrics
from mooncake_vllm.proxy.prefix import prefix_key
from mooncake_vllm.proxy.routing import Policy
from mooncake_vllm.proxy.stream import DecodeStream

logger = logging.getLogger("mooncake_vllm.proxy")


def json_response(body: dict[str, Any], status: int) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json")


# ---- one client request -------------------------------------------------------------------------


async def generate(
    backends: Backends, ctx: RequestContext, body: dict[str, Any], raw: bytes
) -> Response:
    """A completion (``body`` parsed from the client's ``raw`` bytes): the prefill leg, then the
    decode's answer, read whole or streamed."""
    outcome = await legs.prefill(backends, ctx, body)
    decode_body = rewrite.decode_body_bytes(raw, body, outcome.kv_transfer_params)
    leg = await legs.open_decode(backends, ctx, decode_body)
    status = leg.response.status
    if not 200 <= status < 300:
        raw = await legs.read_decode(backends, leg)
        if status >= 500:
            backends.metrics.backend_errors.labels("decode", leg.backend.url, "http_5xx").inc()
        raise ProxyError(status, rewrite.backend_error_body("decode", status, raw))
    if not rewrite.wants_stream(body):
        raw = await legs.read_decode(backends, leg)
        backends.metrics.first_decode_byte_seconds.observe(time.monotonic() - ctx.started_s)
        content_type = leg.response.headers.get("Content-Type", "application/json")
        return Response(raw, status=status, content_type=content_type)
    stream = DecodeStream(backends, leg, ctx)
    response = Response(stream, status=status, mimetype="text/event-stream")
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
        RegistryFollower(backends, cfg.discover, cfg.discover_interval_s) if cfg.discover else None
    )
    app.extensions["registry_follower"] = follower  # tests wait on its rounds
    # Read once: the key the backends expect when the client's key is not forwarded.
    env_api_key = os.environ.get("OPENAI_API_KEY") or None

    @app.before_serving
    async def _start() -> None:
        await backends.open()
        prober.start()
        if follower is not None:
            follower.start()

    @app.after_serving
    async def _stop() -> None:
        if follower is not None:
            await follower.stop()
        await prober.stop()  # before the session it probes with closes
        await backends.close()

    @app.before_request
    async def _begin_request() -> Response | None:
        g.started_s = time.monotonic()
        g.request_id = rewrite.request_id_from(request.headers.get("X-Request-Id"))
        if cfg.api_key is not None and request.path.startswith("/v1/"):
            return _refuse_wrong_api_key(cfg.api_key)
        return None

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
        headers = rewrite.backend_headers(
            request_id=g.request_id,
            client_authorization=request.headers.get("Authorization"),
            forward_client_authorization=cfg.api_key is None,
            env_api_key=env_api_key,
        )
        return RequestContext(g.request_id, g.started_s, request.path, headers)

    async def generation() -> Response:
        raw = await request.get_data(cache=False)
        try:
            body = rewrite.parse_body(raw)
            rewrite.validate_body(body, request.path)
        except rewrite.InvalidRequest as e:
            raise ProxyError.of(400, e.message, "invalid_request_error", e.param) from e
        ctx = request_context()
        if cfg.policy is Policy.PREFIX:
            ctx = dataclasses.replace(ctx, prefix_key=prefix_key(body))
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


def _refuse_wrong_api_key(api_key: str) -> Response | None:
    """A 401 unless the request carries ``Authorization: Bearer <api_key>``."""
    expected = f"Bearer {api_key}".encode()
    sent = request.headers.get("Authorization", "").encode()
    if hmac.compare_digest(sent, expected):
        return None
    body = rewrite.openai_error(
        "missing or wrong API key; send 'Authorization: Bearer <key>'",
        "authentication_error",
        code="invalid_api_key",
    )
    return json_response(body, 401)


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
