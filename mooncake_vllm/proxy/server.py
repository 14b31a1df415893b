"""The proxy's command line and serving it with hypercorn.

    mooncake-vllm-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

SIGINT and SIGTERM stop accepting connections, give running requests ``SHUTDOWN_GRACE_S`` to
finish, then close the backend sessions and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from pydantic import ValidationError

from mooncake_vllm.proxy.app import create_app
from mooncake_vllm.proxy.config import LogLevel, ProxyConfig
from mooncake_vllm.proxy.routing import Policy

logger = logging.getLogger("mooncake_vllm.proxy")

# Running requests (including streams) get this long after SIGTERM before they are cut.
SHUTDOWN_GRACE_S = 5.0


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
        required=True,
        metavar="URL",
        help="prefill vLLM base URL, http://HOST:PORT; repeat for several",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="decode vLLM base URL, http://HOST:PORT; repeat for several",
    )
    p.add_argument("--host", default=defaults["host"].default, help="bind address (%(default)s)")
    p.add_argument("--port", type=int, default=defaults["port"].default, help="(%(default)s)")
    p.add_argument(
        "--policy",
        choices=[x.value for x in Policy],
        default=defaults["policy"].default.value,
        help="how a backend is chosen within a pool (%(default)s)",
    )
    p.add_argument(
        "--mode",
        choices=["p2p", "pool"],
        default=defaults["mode"].default,
        help="p2p: hand the KV over through kv_transfer_params (MooncakeConnector); pool: pass "
        "nothing, the decode gets the prompt from the pool (MooncakeStoreConnector) (%(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY'; backends then get $OPENAI_API_KEY",
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
        "--log-level",
        choices=list(LogLevel.__args__),
        default=defaults["log_level"].default,
        help="(%(default)s)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    """Parse and validate the command line; exits with status 2 naming the bad flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return ProxyConfig(**vars(args))
    except ValidationError as e:
        problems = []
        for err in e.errors():
            flag = "--" + str(err["loc"][0]).replace("_", "-")
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"{flag}: {message} (got {err['input']!r})")
        parser.error("; ".join(problems))
        raise AssertionError("unreachable") from e  # parser.error exits


def hypercorn_config(cfg: ProxyConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    hc.bind = [f"{host}:{cfg.port}"]
    hc.graceful_timeout = SHUTDOWN_GRACE_S
    hc.accesslog = None  # the app logs each request with its legs
    hc.errorlog = logger
    return hc


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
    await hypercorn_serve(app, hypercorn_config(cfg), shutdown_trigger=shutdown_trigger)
    logger.info("proxy stopped")


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    logger.info("%s received, shutting down", sig.name)
    stop.set()


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger.info(
        "prefill %s, decode %s, policy %s",
        ", ".join(cfg.prefill),
        ", ".join(cfg.decode),
        cfg.policy.value,
    )
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
