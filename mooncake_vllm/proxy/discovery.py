"""Following the engine registry (``--discover``): backends join and leave the pools.

Each engine with a metadata store publishes a ``protocol.ServingRecord`` (its OpenAI URL and
role) under ``mooncake-vllm/serving/<engine_id>``, refreshed by a heartbeat, deleted when the
engine stops, and expiring ``metadata_ttl_s`` after a crash. The follower reads that prefix every
``--discover-interval-s``:

- a URL that appears is added to its pool(s) *out of rotation*, with a health probe due at once
  (``BackendPool.add``): the record is published while vLLM is still starting, and the first
  passing probe (within about a second of ``/health`` answering) brings it in;
- a URL whose record is gone is removed (requests already on it finish);
- static ``--prefill``/``--decode`` backends are never removed, and a discovered URL that is also
  static is left to the static entry.

A store that cannot be read leaves the pools as they are (logged once until it answers again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import msgspec

from mooncake_vllm.metadata import Store, StoreUnavailable, open_store, parse_metadata_server
from mooncake_vllm.protocol import SERVING_PREFIX, decode_serving
from mooncake_vllm.proxy.config import normalize_backend_url
from mooncake_vllm.proxy.failover import Backends
from mooncake_vllm.proxy.health import stop_task

logger = logging.getLogger("mooncake_vllm.proxy")

# Which pools an engine of each kv_role serves in.
POOLS_OF_ROLE = {
    "kv_producer": ("prefill",),
    "kv_consumer": ("decode",),
    "kv_both": ("prefill", "decode"),
}


def wanted_backends(
    records: Mapping[str, bytes], bad: set[str] | None = None
) -> dict[str, dict[str, str]]:
    """Registry values → ``{pool: {url: engine_id}}``. Keys whose record cannot be used are
    skipped and added to ``bad`` (the caller logs each once)."""
    wanted: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    for key, data in sorted(records.items()):
        try:
            record = decode_serving(data)
            url = normalize_backend_url(record.url)
            pools = POOLS_OF_ROLE[record.role]
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, KeyError):
            if bad is not None:
                bad.add(key)
            continue
        for pool in pools:
            wanted[pool].setdefault(url, record.engine_id)
    return wanted


class RegistryFollower:
    """Keeps the pools of ``backends`` in step with the registry; owns its task and store."""

    def __init__(self, backends: Backends, store_url: str, interval_s: float) -> None:
        self._backends = backends
        self._target = parse_metadata_server(store_url)
        self._interval_s = interval_s
        self._store: Store | None = None
        self._task: asyncio.Task[None] | None = None
        self._static = {r: {b.url for b in pool.backends} for r, pool in backends.pools.items()}
        self._discovered: dict[str, set[str]] = {role: set() for role in backends.pools}
        self._store_ok = True
        self._bad_logged: set[str] = set()
        self.rounds = 0  # registry reads that succeeded (tests wait on it)

    def start(self) -> None:
        self._store = open_store(self._target)
        self._task = asyncio.create_task(self.follow_forever(), name="proxy-registry-follower")

    async def stop(self) -> None:
        await stop_task(self._task, "registry follower")
        self._task = None
        if self._store is not None:
            await self._store.close()
            self._store = None

    async def follow_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                logger.exception("reading the engine registry failed")
            await asyncio.sleep(self._interval_s)

    async def refresh(self) -> None:
        """One read of the registry, applied to the pools."""
        assert self._store is not None, "start() first"
        try:
            records = await self._store.list(SERVING_PREFIX)
        except StoreUnavailable as e:
            if self._store_ok:
                logger.warning("engine registry unreadable, pools kept as they are: %s", e)
            self._store_ok = False
            return
        if not self._store_ok:
            logger.warning("engine registry readable again (%s)", self._target.describe())
        self._store_ok = True
        bad: set[str] = set()
        wanted = wanted_backends(records, bad)
        for key in bad - self._bad_logged:
            logger.warning("registry key %s holds no usable serving record; ignored", key)
        self._bad_logged = bad
        for role, pool in self._backends.pools.items():
            urls = {u: e for u, e in wanted[role].items() if u not in self._static[role]}
            for url, engine_id in urls.items():
                if url not in self._discovered[role] and pool.add(url) is not None:
                    self._discovered[role].add(url)
                    self._backends.metrics.declare_backends(role, [url])
                    logger.info("%s backend %s joined (engine %s)", role, url, engine_id)
            for url in self._discovered[role] - urls.keys():
                pool.remove(url)
                self._discovered[role].discard(url)
                logger.info("%s backend %s left (its registry record is gone)", role, url)
        self.rounds += 1
