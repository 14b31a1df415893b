"""The ASGI servers the Quart app can run on: uvicorn (default), granian, hypercorn.

All three serve the same app in the caller's event loop until ``shutdown_trigger`` returns, then
stop accepting connections and give running requests ``grace_s`` to finish. They differ only in
cost per request: ``benchmarks.proxy`` measures them side by side (README, "Proxy cost"), and the
fastest there is the default. Each server's own signal handling is turned off: ``server.serve``
owns SIGINT/SIGTERM for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable

from quart import Quart

logger = logging.getLogger("mooncake_vllm.proxy")

ShutdownTrigger = Callable[[], Awaitable[object]]


class HttpServer(str, enum.Enum):
    UVICORN = "uvicorn"
    GRANIAN = "granian"
    HYPERCORN = "hypercorn"


# The fastest in benchmarks.proxy (README, "Proxy cost"): uvicorn with httptools on uvloop.
DEFAULT_HTTP_SERVER = HttpServer.UVICORN


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def serve_hypercorn(
    app: Quart, host: str, port: int, shutdown_trigger: ShutdownTrigger, grace_s: float
) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    hc = Config()
    hc.bind = [f"{_bracket(host)}:{port}"]
    hc.graceful_timeout = grace_s
    hc.accesslog = None  # the app logs each request with its legs
    hc.errorlog = logger
    await serve(app, hc, shutdown_trigger=shutdown_trigger)


async def serve_uvicorn(
    app: Quart, host: str, port: int, shutdown_trigger: ShutdownTrigger, grace_s: float
) -> None:
    import uvicorn

    from mooncake_vllm.proxy.http_head import BoundedHttpToolsProtocol

    class _Server(uvicorn.Server):
        # uvicorn's own handlers would re-raise the signal after a clean stop (exit status -15).
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=BoundedHttpToolsProtocol,  # httptools, with the request head bounded
        loop="none",  # the caller's loop (uvloop when server.main runs it)
        lifespan="on",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=grace_s,
    )
    server = _Server(config)
    await _until_trigger(
        server.serve(), shutdown_trigger, lambda: setattr(server, "should_exit", True)
    )


async def serve_granian(
    app: Quart, host: str, port: int, shutdown_trigger: ShutdownTrigger, grace_s: float
) -> None:
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    server = Server(
        app,
        address=host,
        port=port,
        interface=Interfaces.ASGI,  # with the lifespan protocol: before/after_serving run
        http=HTTPModes.http1,
        websockets=False,
        log_enabled=False,  # granian's access and startup lines; the app logs what matters
        runtime_threads=1,
    )
    server.workers_kill_timeout = grace_s
    await _until_trigger(server.serve(), shutdown_trigger, server.stop)


async def _until_trigger(
    serving: Awaitable[None], shutdown_trigger: ShutdownTrigger, stop: Callable[[], object]
) -> None:
    """Run ``serving`` until it ends or ``shutdown_trigger`` returns, then ``stop()`` and wait."""
    serve_task = asyncio.ensure_future(serving)
    trigger_task = asyncio.ensure_future(shutdown_trigger())
    try:
        await asyncio.wait({serve_task, trigger_task}, return_when=asyncio.FIRST_COMPLETED)
        if not serve_task.done():
            stop()
        await serve_task  # re-raises a server that failed to start (port in use...)
    finally:
        trigger_task.cancel()
        if not serve_task.done():
            serve_task.cancel()


# The module each server needs; uvicorn's come with the package, the others with its
# ``proxy-servers`` extra.
_MODULES = {HttpServer.GRANIAN: "granian", HttpServer.HYPERCORN: "hypercorn"}


def check_installed(server: HttpServer) -> HttpServer:
    """``server`` if it can be imported; ValueError naming the extra to install otherwise."""
    import importlib.util

    module = _MODULES.get(server)
    if module is not None and importlib.util.find_spec(module) is None:
        raise ValueError(
            f"{server.value} is not installed: pip install 'mooncake-vllm[proxy-servers]', "
            "or use the default --server uvicorn"
        )
    return server


SERVE = {
    HttpServer.UVICORN: serve_uvicorn,
    HttpServer.GRANIAN: serve_granian,
    HttpServer.HYPERCORN: serve_hypercorn,
}
