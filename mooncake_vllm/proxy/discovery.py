"""Following the engine registry (``--discover``): backends join and leave the pools.

Each engine with a metadata store publishes a ``protocol.ServingRecord`` (its OpenAI URL and
role) under ``mooncake-vllm/serving/<engine_id>``, refreshed by a heartbeat, deleted when the
engine stops, and expiring ``metadata_ttl_s`` after a crash. The follower reads that prefix every
``--discover-interval-s``:

- a URL that appears is added to its pool(s) *out of rotation*, with a health probe due at once
  (``BackendPool.add``): the record is published while vLLM is still starting, and the first
  passing probe (within about a second of ``/health`` answering) brings it in;
- a URL whose record is gone is removed (requests already on it finish). Calls still waiting
  for its answer are sent elsewhere only if the record stays away for ``--discover-grace-s``:
  a stopped engine answers them never (``failover.Backends.abandon``), but a record can also
  lapse under a live engine whose heartbeat was late (a starved host), and its calls then
  answer as usual; the record's return brings the backend back (out of rotation until probed);
- static ``--prefill``/``--decode`` backends are never removed, and a discovered URL that is also
  static is left to the static entry.

A store that cannot be read leaves the pools as they are (logged once until it answers again).
A store that comes back from an outage, or whose registry is suddenly empty, may have lost its
data (a restarted redis without persistence, a fresh http server): its records return only as
each engine's heartbeat republishes them (within a third of ``metadata_ttl_s``). Records missing
then are not engines leaving: their backends stay for ``--discover-grace-s`` (or until their
records return); only records gone from a store that has answered all along leave at once.

With the shared secret (``--auth-secret-file``/``--auth-secret-env``) every record must verify
(``auth.open_record``): an unsigned or forged one is ignored, logged once per key and counted
(``mooncake_proxy_registry_records_ignored``), and the backends of the records that verify are
trusted with the clients' Authorization (``routing.Backend.trusted``). Without it, records are
read as they are, signed or not, and discovered backends get no Authorization header: whoever can
write to the store would otherwise collect the keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import msgspec

from mooncake_vllm.core import auth
from mooncake_vllm.core.registry import SERVING_PREFIX, decode_serving
from mooncake_vllm.metadata import (
    MetadataAuth,
    Store,
    StoreUnavailable,
    open_store,
    parse_metadata_server,
)
from mooncake_vllm.proxy.config import normalize_backend_url
from mooncake_vllm.proxy.failover import Backends
from mooncake_vllm.proxy.health import stop_task
from mooncake_vllm.proxy.routing import Backend

logger = logging.getLogger("mooncake_vllm.proxy")

# Which pools an engine of each kv_role serves in.
POOLS_OF_ROLE = {
    "kv_producer": ("prefill",),
    "kv_consumer": ("decode",),
    "kv_both": ("prefill", "decode"),
}


# Why a registry record was ignored: the label of mooncake_proxy_registry_records_ignored.
UNSIGNED, BAD_SIGNATURE, INVALID = "unsigned", "bad_signature", "invalid"
_IGNORED_BECAUSE = {
    UNSIGNED: "is not signed, and --auth-secret-* asks for signed records",
    BAD_SIGNATURE: "is signed with a key --auth-secret-* does not hold (forged, or a secret "
    "not rolled out here)",
    INVALID: "holds no usable serving record",
}


def wanted_backends(
    records: Mapping[str, bytes], bad: dict[str, str] | None = None, keys: auth.Keys = ()
) -> dict[str, dict[str, str]]:
    """Registry values → ``{pool: {url: engine_id}}``. With ``keys`` only records that verify
    count. Keys whose record cannot be used are skipped and put in ``bad`` with the reason
    (``UNSIGNED``, ``BAD_SIGNATURE``, ``INVALID``); the caller logs each once."""
    wanted: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    for key, data in sorted(records.items()):
        try:
            record = decode_serving(auth.open_record(keys, data))
            url = normalize_backend_url(record.url)
            pools = POOLS_OF_ROLE[record.role]
        except auth.AuthError:
            if bad is not None:
                signed = data.startswith(auth.RECORD_MAGIC)
                bad[key] = BAD_SIGNATURE if signed else UNSIGNED
            continue
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, KeyError):
            if bad is not None:
                bad[key] = INVALID
            continue
        for pool in pools:
            wanted[pool].setdefault(url, record.engine_id)
    return wanted


class RegistryFollower:
    """Keeps the pools of ``backends`` in step with the registry; owns its task and store."""

    def __init__(
        self,
        backends: Backends,
        store_url: str,
        interval_s: float,
        keys: auth.Keys = (),
        store_auth: MetadataAuth | None = None,
        grace_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        store: Store | None = None,
    ) -> None:
        """``store``: an open store to read instead of opening ``store_url`` (tests)."""
        self._backends = backends
        self._target = parse_metadata_server(store_url)
        self._interval_s = interval_s
        self._grace_s = grace_s
        self._clock = clock
        # Until then, a discovered backend whose record is missing stays: the store may have
        # lost its data, and the engines republish on their next heartbeat.
        self._keep_missing_until_s = float("-inf")
        self._had_records = False
        self._keys = keys
        self._store_auth = MetadataAuth() if store_auth is None else store_auth
        self._store: Store | None = store
        self._task: asyncio.Task[None] | None = None
        self._static = {r: {b.url for b in pool.backends} for r, pool in backends.pools.items()}
        self._discovered: dict[str, set[str]] = {role: set() for role in backends.pools}
        self._store_ok = True
        self._bad_logged: dict[str, str] = {}  # key -> reason, as last logged
        # Backends whose records went away, by (role, url): when, and the removed Backend whose
        # waiting calls are abandoned if the record stays away for grace_s.
        self._left: dict[tuple[str, str], tuple[float, Backend]] = {}
        self.rounds = 0  # registry reads that succeeded (tests wait on it)

    def start(self) -> None:
        if self._store is None:
            self._store = open_store(self._target, self._store_auth)
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
        now = self._clock()
        if not self._store_ok:
            logger.warning("engine registry readable again (%s)", self._target.describe())
            self._hold_missing(now, "the store was unreadable")
        elif self._had_records and not records:
            self._hold_missing(now, "every record vanished at once")
        self._store_ok = True
        self._had_records = bool(records)
        bad: dict[str, str] = {}
        wanted = wanted_backends(records, bad, self._keys)
        for key, reason in bad.items():
            if self._bad_logged.get(key) != reason:
                logger.warning("registry key %s %s; ignored", key, _IGNORED_BECAUSE[reason])
                self._backends.metrics.registry_records_ignored.labels(reason).inc()
        self._bad_logged = bad
        for role, pool in self._backends.pools.items():
            urls = {u: e for u, e in wanted[role].items() if u not in self._static[role]}
            for url, engine_id in urls.items():
                trusted = bool(self._keys)  # every record in ``wanted`` verified
                if url not in self._discovered[role] and pool.add(url, trusted=trusted) is not None:
                    self._discovered[role].add(url)
                    self._backends.metrics.declare_backends(role, [url])
                    logger.info("%s backend %s joined (engine %s)", role, url, engine_id)
            if now < self._keep_missing_until_s:
                continue  # no backend leaves: see _hold_missing
            for url in self._discovered[role] - urls.keys():
                gone = pool.remove(url)
                self._discovered[role].discard(url)
                if gone is not None:
                    self._left[(role, url)] = (now, gone)
                logger.info("%s backend %s left (its registry record is gone)", role, url)
        self._abandon_the_stopped(now, wanted)
        self.rounds += 1

    def _abandon_the_stopped(self, now: float, wanted: Mapping[str, Mapping[str, str]]) -> None:
        """Calls still waiting on a backend whose record has been away for ``grace_s`` are sent
        elsewhere: its engine has stopped and will not answer them. A record back sooner had
        lapsed under a live engine: its calls go on."""
        for (role, url), (since_s, gone) in list(self._left.items()):
            if url in wanted[role]:
                del self._left[(role, url)]
                logger.info("%s backend %s is back in the registry: its record had lapsed, "
                            "its calls go on", role, url)  # fmt: skip
            elif now - since_s >= self._grace_s:
                del self._left[(role, url)]
                resent = self._backends.abandon(gone)
                if resent:
                    logger.info("%s backend %s stayed out of the registry for %gs: %d calls "
                                "waiting on it sent elsewhere", role, url, self._grace_s,
                                resent)  # fmt: skip

    def _hold_missing(self, now: float, why: str) -> None:
        """The store may have lost its data (restarted empty): for ``grace_s`` a missing record
        is not an engine leaving. A backend that really stopped meanwhile is out of rotation by
        its failing health probes; it leaves when the grace ends."""
        self._keep_missing_until_s = now + self._grace_s
        logger.warning(
            "engine registry: %s; discovered backends stay for %gs while engines republish",
            why,
            self._grace_s,
        )
