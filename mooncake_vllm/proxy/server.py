"""The proxy's command line and serving it (uvicorn by default; see ``http_servers``).

    mooncake-vllm-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Without ``--prefill``/``--decode`` the pools are those of the Mooncake guide's command line
(``GUIDE_PREFILL``, ``GUIDE_DECODE``), so ``python proxy/proxy_server.py`` works as it shows.

SIGINT and SIGTERM stop accepting connections, give running requests ``SHUTDOWN_GRACE_S`` to
finish, then close the backend sessions and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from pydantic import ValidationError

from mooncake_vllm.metadata import redact_url
from mooncake_vllm.proxy.app import create_app
from mooncake_vllm.proxy.config import LogLevel, ProxyConfig
from mooncake_vllm.proxy.http_servers import SERVE, HttpServer
from mooncake_vllm.proxy.routing import Policy

logger = logging.getLogger("mooncake_vllm.proxy")

# Running requests (including streams) get this long after SIGTERM before they are cut.
SHUTDOWN_GRACE_S = 5.0
# The backends when no --prefill/--decode is given: the ports of the Mooncake guide.
GUIDE_PREFILL = "http://localhost:8100"
GUIDE_DECODE = "http://localhost:8200"


def build_parser() -> argparse.ArgumentParser:
    defaults = ProxyConfig.model_fields
    p = argparse.ArgumentParser(
        prog="mooncake-vllm-proxy",
        description="Prefill/decode proxy for vLLM: prefill with max_tokens=1, then stream the "
        "decode, handing the KV over through kv_transfer_params.",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help=f"prefill vLLM base URL, http://HOST:PORT; repeat for several ({GUIDE_PREFILL})",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help=f"decode vLLM base URL, http://HOST:PORT; repeat for several ({GUIDE_DECODE})",
    )
    p.add_argument(
        "--discover",
        default=None,
        metavar="STORE",
        help="also take backends from the engine registry in this metadata store "
        "(etcd://HOST:PORT, redis://HOST:PORT, http://HOST:PORT/metadata): engines that publish "
        "themselves join, engines whose record goes away leave",
    )
    p.add_argument(
        "--discover-interval-s",
        type=float,
        default=defaults["discover_interval_s"].default,
        help="how often the registry is read (%(default)s)",
    )
    p.add_argument(
        "--discover-grace-s",
        type=float,
        default=defaults["discover_grace_s"].default,
        help="after the store was unreadable or emptied (restarted without its data), how long "
        "backends whose records are missing stay while engines republish (%(default)s)",
    )
    p.add_argument("--host", default=defaults["host"].default, help="bind address (%(default)s)")
    p.add_argument("--port", type=int, default=defaults["port"].default, help="(%(default)s)")
    p.add_argument(
        "--policy",
        choices=[x.value for x in Policy],
        default=defaults["policy"].default.value,
        help="how a backend is chosen within a pool (%(default)s); kv: by the engines' own "
        "KV events (needs --kv-events)",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=tcp://HOST:PORT",
        help="a backend's KV event publisher (its vLLM's --kv-events-config endpoint), for "
        "--policy kv; once per engine",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH_OR_NAME",
        help="--policy kv: tokenize text and chat prompts with this model's tokenizer and chat "
        "template (default: the model the engines serve, from their /v1/models)",
    )
    p.add_argument(
        "--server",
        choices=[x.value for x in HttpServer],
        default=defaults["server"].default.value,
        help="the ASGI server the Quart app runs on (%(default)s: the fastest in benchmarks.proxy)",
    )
    p.add_argument(
        "--mode",
        choices=["p2p", "pool"],
        default=defaults["mode"].default,
        help="p2p: hand the KV over through kv_transfer_params (MooncakeConnector); pool: pass "
        "nothing, the decode gets the prompt from the pool (MooncakeStoreConnector) (%(default)s)",
    )
    p.add_argument(
        "--dispatch",
        choices=["sequential", "concurrent"],
        default=defaults["dispatch"].default,
        help="sequential: the decode request goes out once the prefill has answered; "
        "concurrent: both at once, the decode waits for the KV (p2p mode) (%(default)s)",
    )
    p.add_argument(
        "--concurrent-max-wait-s",
        type=float,
        default=defaults["concurrent_max_wait_s"].default,
        help="under --dispatch concurrent, a request whose prefill is expected to answer later "
        "than this (a deep queue) goes sequentially; keep it below the decode's load_timeout_s "
        "(%(default)s)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=defaults["timeout_s"].default,
        help="deadline for a whole request, streaming included (%(default)s)",
    )
    p.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=defaults["prefill_timeout_s"].default,
        help="deadline for the prefill answer (%(default)s)",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=defaults["connect_timeout_s"].default,
        help="deadline for opening a backend connection and for a health probe (%(default)s)",
    )
    p.add_argument(
        "--health-interval-s",
        type=float,
        default=defaults["health_interval_s"].default,
        help="probe period of healthy backends; ejected ones back off 1s..30s (%(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults["max_body_bytes"].default,
        help="largest client request body; larger ones get 413 (%(default)s)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=defaults["body_timeout_s"].default,
        help="deadline for a client's whole request body after its head; later gets 408 "
        "(%(default)s)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry spans (the request, each leg) by OTLP/HTTP to URL, e.g. "
        "http://collector:4318/v1/traces; each leg's traceparent makes the engine's spans "
        "children of the leg's (give vLLM --otlp-traces-endpoint too). Off by default",
    )
    p.add_argument(
        "--max-prompts",
        type=int,
        default=defaults["max_prompts"].default,
        help="most prompts in one /v1/completions list; more get 400 (%(default)s)",
    )
    p.add_argument(
        "--prompt-list-concurrency",
        type=int,
        default=defaults["prompt_list_concurrency"].default,
        help="legs of one prompt list sent at once; each holds a copy of the request body "
        "(%(default)s)",
    )
    p.add_argument(
        "--log-level",
        choices=list(LogLevel.__args__),
        default=defaults["log_level"].default,
        help="(%(default)s)",
    )
    _add_client_flags(p)
    _add_trust_flags(p)
    return p


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    clients = p.add_argument_group(
        "clients",
        "An API key (at most one of the three forms): clients must send 'Authorization: Bearer "
        "KEY' on /v1/*, and backends get $OPENAI_API_KEY instead of it. A file or variable may "
        "hold several keys, one per line.",
    )
    clients.add_argument(
        "--api-key-file", default=None, metavar="PATH", help="read the key from this file"
    )
    clients.add_argument(
        "--api-key-env",
        default=None,
        metavar="NAME",
        help="read the key from this environment variable",
    )
    clients.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="the key itself: every user of this host sees it in the process list; prefer "
        "--api-key-file or --api-key-env",
    )
    clients.add_argument(
        "--protect-metrics", action="store_true", help="/metrics asks for the API key too"
    )
    clients.add_argument(
        "--protect-health", action="store_true", help="/health asks for the API key too"
    )
    clients.add_argument(
        "--client-max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="requests in flight per client (its API key, else its address); more get 429 "
        "(default: no limit)",
    )
    clients.add_argument(
        "--client-rate",
        type=float,
        default=None,
        metavar="R",
        help="requests per second per client, as a token bucket; more get 429 with Retry-After "
        "(default: no limit)",
    )
    clients.add_argument(
        "--client-burst",
        type=int,
        default=None,
        metavar="N",
        help="requests a client may send at once under --client-rate (default: one second's "
        "worth, at least 1)",
    )


def _add_trust_flags(p: argparse.ArgumentParser) -> None:
    trust = p.add_argument_group(
        "registry trust (--discover)",
        "The shared secret the engines sign their registry records with (the connector's "
        "auth_secret_file/auth_secret_env): records that do not verify are ignored, and only "
        "discovered backends whose record verified get the client's Authorization header. The "
        "store's own credentials are read from files or the environment.",
    )
    trust.add_argument("--auth-secret-file", default=None, metavar="PATH", help="one key a line")
    trust.add_argument("--auth-secret-env", default=None, metavar="NAME")
    trust.add_argument("--discover-user", default=None, metavar="USER")
    for what in ("password", "token"):
        trust.add_argument(f"--discover-{what}-file", default=None, metavar="PATH")
        trust.add_argument(f"--discover-{what}-env", default=None, metavar="NAME")
    trust.add_argument(
        "--discover-ca-file", default=None, metavar="PATH", help="CA bundle for a TLS store"
    )
    trust.add_argument(
        "--discover-cert-file", default=None, metavar="PATH", help="client certificate (TLS)"
    )
    trust.add_argument(
        "--discover-key-file", default=None, metavar="PATH", help="its private key (TLS)"
    )


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    """Parse and validate the command line; exits with status 2 naming the bad flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.discover is None:  # the guide's command line: no flags at all
        args.prefill = args.prefill or [GUIDE_PREFILL]
        args.decode = args.decode or [GUIDE_DECODE]
    try:
        return ProxyConfig(**vars(args))
    except ValidationError as e:
        problems = []
        for err in e.errors():
            message = err["msg"].removeprefix("Value error, ")
            if not err["loc"]:  # a check across flags: its message names them
                problems.append(message)
                continue
            flag = "--" + str(err["loc"][0]).replace("_", "-")
            problems.append(f"{flag}: {message} (got {err['input']!r})")
        parser.error("; ".join(problems))
        raise AssertionError("unreachable") from e  # parser.error exits


async def serve(
    cfg: ProxyConfig, shutdown_trigger: Callable[[], Awaitable[object]] | None = None
) -> None:
    """Serve until ``shutdown_trigger`` returns; without one, until SIGINT or SIGTERM."""
    app = create_app(cfg)
    if shutdown_trigger is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _on_signal, sig, stop)
        shutdown_trigger = stop.wait
    serve_on = SERVE[HttpServer(cfg.server)]
    await serve_on(app, cfg.host, cfg.port, shutdown_trigger, SHUTDOWN_GRACE_S)
    logger.info("proxy stopped")


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    logger.info("%s received, shutting down", sig.name)
    stop.set()


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger.info(startup_line(cfg))
    for warning in startup_warnings(cfg):
        logger.warning(warning)
    _run(serve(cfg))


def startup_line(cfg: ProxyConfig) -> str:
    """The first log line: where the proxy listens and which backends it sends to; the
    registry's URL without its credentials (backend URLs cannot carry any: ``config``)."""
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    return (
        f"serving on http://{host}:{cfg.port} ({cfg.server.value}), "
        f"prefill {', '.join(cfg.prefill) or '-'}, decode {', '.join(cfg.decode) or '-'}, "
        f"policy {cfg.policy.value}"
        + (f", discovering backends in {redact_url(cfg.discover)}" if cfg.discover else "")
    )


def startup_warnings(cfg: ProxyConfig) -> list[str]:
    """What a user should change in the command line it gave."""
    warnings = []
    if cfg.api_key is not None:
        warnings.append(
            "--api-key puts the key in the process arguments, which every user of this host "
            "can read (ps, /proc/PID/cmdline); use --api-key-file PATH or --api-key-env NAME"
        )
    if cfg.discover is not None and not cfg.auth_keys():
        warnings.append(
            "--discover without --auth-secret-file/--auth-secret-env: registry records are not "
            "verified, so discovered backends get no Authorization header (neither the "
            "client's nor $OPENAI_API_KEY)"
        )
    return warnings


def _run(main_coro: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run`` on uvloop when it is installed (the proxy's measured setup)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
        return
    uvloop.run(main_coro)


if __name__ == "__main__":
    main()
