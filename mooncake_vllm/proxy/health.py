"""The background health prober and the ``/health`` report.

``routing.BackendPool`` decides what a probe's outcome means (eject, back off, bring back); this
module only sends the probes, on the schedule the pools give, and reports what changed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from mooncake_vllm.proxy.failover import Backends
from mooncake_vllm.proxy.routing import Backend, BackendPool

logger = logging.getLogger("mooncake_vllm.proxy")

# Longest sleep of the prober; a shorter one when a probe is due sooner.
_PROBER_MAX_SLEEP_S = 1.0


def healthy(backends: Backends) -> bool:
    """True when the proxy can serve: a decode is in rotation. Without a prefill in rotation
    the decodes compute prompts themselves (``legs.prefill``): slower, but served."""
    return backends.pools["decode"].any_healthy()


def health_report(backends: Backends) -> dict[str, Any]:
    """``status``: ``ok`` (both pools have a backend in rotation), ``degraded`` (no prefill:
    decodes compute prompts themselves) or ``unavailable`` (no decode)."""
    if not healthy(backends):
        status = "unavailable"
    else:
        status = "ok" if backends.pools["prefill"].any_healthy() else "degraded"
    report: dict[str, Any] = {"status": status}
    for role, pool in backends.pools.items():
        report[role] = pool.snapshot()
    return report


async def stop_task(task: asyncio.Task | None, what: str) -> None:
    """Cancel a background task and await it; a failure it ended with is logged, not lost."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:
        logger.exception("%s had failed", what)


class HealthProber:
    """Probes every backend with ``GET /health`` while the app serves; owns its task."""

    def __init__(self, backends: Backends) -> None:
        self._backends = backends
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        # Each probe on a connection of its own: a backend that has stopped listening (a vLLM
        # whose engine is gone) still answers on a kept-alive connection, and that it accepts
        # connections is what a probe checks.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), cookie_jar=aiohttp.DummyCookieJar()
        )
        self._task = asyncio.create_task(self.probe_forever(), name="proxy-health-prober")

    async def stop(self) -> None:
        await stop_task(self._task, "health prober")
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe_forever(self) -> None:
        """Probe due backends, sleep until the next is due; runs until cancelled."""
        pools = self._backends.pools.values()
        while True:
            try:
                due = [(pool, b) for pool in pools for b in pool.due_for_probe()]
                results = await asyncio.gather(
                    *(self.probe(pool, b) for pool, b in due), return_exceptions=True
                )
                for (pool, backend), result in zip(due, results, strict=True):
                    if isinstance(result, Exception):
                        # Count it as a failed probe so the backend backs off instead of being
                        # probed again at once.
                        logger.error("probe of %s crashed", backend.url, exc_info=result)
                        pool.probe_failed(backend, f"probe crashed: {result!r}")
                sleep_s = min(p.seconds_until_next_probe() for p in pools)
            except Exception:
                logger.exception("health probe round failed")
                sleep_s = _PROBER_MAX_SLEEP_S
            await asyncio.sleep(min(max(sleep_s, 0.01), _PROBER_MAX_SLEEP_S))

    async def probe(self, pool: BackendPool, backend: Backend) -> None:
        """One ``GET /health``: 200 means healthy, anything else (or no answer) means not."""
        timeout_s = self._backends.cfg.connect_timeout_s
        session = self._session
        if session is None:
            raise RuntimeError("the health prober is not started")
        try:
            async with session.get(
                backend.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                status = resp.status
        except asyncio.TimeoutError:
            reason = f"health probe got no answer in {timeout_s:g}s"
            ejected = pool.probe_timed_out(backend, reason)  # a busy backend answers late
        except aiohttp.ClientConnectorError as e:
            reason = f"health probe failed: {str(e) or type(e).__name__}"
            ejected = pool.probe_failed(backend, reason)
            # Nothing listens there any more: a vLLM whose engine has gone closes its listener
            # only after its engine client has stopped, so a call still waiting on it is never
            # answered (drain.py); send it elsewhere now rather than at its deadline.
            resent = self._backends.abandon(backend)
            if resent:
                logger.warning(
                    "%s backend %s no longer listens: %d calls waiting on it go elsewhere",
                    pool.role,
                    backend.url,
                    resent,
                )
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
            self._backends.report_ejection(pool, backend, reason)
        else:
            logger.info("%s backend %s: %s", pool.role, backend.url, reason)
