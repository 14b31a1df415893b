"""The proxy served in a test's own event loop, with fake backends beside it: no vLLM, no
subprocess, seconds a test.

``proxies()`` runs ``mooncake_vllm.proxy.server.serve`` (its default server, as
``mooncake-vllm-proxy`` runs it) as a task on a free loopback port, and stops every one it started
when its block ends, however it ends; ``start_app`` serves a fake backend's aiohttp app.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from harness.servers import free_port
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.server import serve


async def wait_for_listener(
    url: str, task: asyncio.Task | None = None, timeout_s: float = 10.0
) -> None:
    """Until ``url/health`` answers at all; the error ``task`` (the server) ended with, if it
    ended first; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if task is not None and task.done():
                task.result()  # raises the startup error
                raise AssertionError("proxy exited during startup")
            try:
                async with session.get(url + "/health"):
                    return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    raise AssertionError(f"nothing listening at {url} after {timeout_s}s")


@contextlib.asynccontextmanager
async def proxies() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """``async with proxies() as start: url = await start(prefill=[...], decode=[...])``: each
    ``start`` serves a proxy with ``ProxyConfig(**config)`` on a free port and returns its URL
    once it listens; every one is shut down (and awaited) when the block ends."""
    running: list[tuple[asyncio.Event, asyncio.Task]] = []

    async def start(**config: Any) -> str:
        cfg = ProxyConfig(port=free_port(), **config)
        stop = asyncio.Event()
        task = asyncio.create_task(serve(cfg, shutdown_trigger=stop.wait))
        running.append((stop, task))
        url = f"http://127.0.0.1:{cfg.port}"
        await wait_for_listener(url, task)
        return url

    try:
        yield start
    finally:
        for stop, task in running:
            stop.set()
            await asyncio.wait_for(task, timeout=10)


async def start_app(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve a fake backend's ``app`` on 127.0.0.1 (``port``, or a free one); its runner (for
    ``cleanup()``) and port. With ``handler_cancellation`` a handler learns that its client went
    away, as vLLM's do."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port
