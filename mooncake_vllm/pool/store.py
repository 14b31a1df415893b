"""The only code that touches ``mooncake.store.MooncakeDistributedStore`` (wheel 0.3.13.post1).

What the store does, measured on this wheel (see the README's pool section):
- ``setup`` returns 0 or a negative code; against an address where no master listens it retries
  for about 90 s, so ``config.check_reachable`` probes the master first.
- ``batch_put_from_multi_buffers(keys, ptrs, sizes)`` stores one object per key from several
  registered ranges (here: one block of every layer's K and V) with no copy on our side; it
  returns 0 per key or a negative code (-200: no space left; -900: master unreachable, after a
  few seconds of reconnecting). Putting a key that exists returns 0 and keeps the old value.
- ``batch_get_into_multi_buffers`` fills the same ranges on the reader and returns the bytes
  read per key, or a negative code (-704: no such object).
- ``batch_is_exist`` returns 1/0/negative per key; while the master is down every call waits
  about 4.5 s in the client's RPC before it answers -900, so after a -900 this class answers -900
  to existence checks and puts itself, without asking, for a while (``MasterAway``): a step must
  not wait on a dead master. Gets always ask: one is made only after a lookup found the blocks,
  so the master was there a moment ago, and it runs off the step thread within its deadline.
- A put goes where the master allocates (any segment) unless its ``ReplicateConfig`` names a
  ``preferred_segment``: naming this client's own segment makes the put a local copy (measured:
  10 MiB in ~7 ms against ~16 ms to a random segment over TCP loopback); readers then pull from
  it. A full own segment falls back to the others.
- ``batch_get_into_multi_buffers`` spins its calling thread until the transfer ends (measured: 50
  gets of 8 MiB, 0.26 s wall, 0.25 s CPU on the caller); the bytes are moved by the client's own
  threads (26 per client, all asleep when idle), which also send the master its heartbeats.
- After the master restarts, the client reconnects and remounts its segment by itself (the
  pool is empty then).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from mooncake_vllm.core.os_threads import adopt_native_threads, native_threads
from mooncake_vllm.metadata import redact_url
from mooncake_vllm.pool.config import PoolSettings

logger = logging.getLogger(__name__)

# Codes worth a name in a log line.
CODES = {
    -200: "no space in the pool",
    -704: "not in the pool",
    -707: "lease expired before the read ended",
    -800: "transfer failed",
    -900: "master unreachable",
    -901: "master timed out",
}
# Get results worth asking again: the object may still be there. -707: the master's lease on
# the object (mooncake_master --default_kv_lease_ttl, 10 s) ran out while a starved read was
# going on; the bytes are right but the object could have been evicted under the reader, so
# the store refuses them. -800: a transfer failed, e.g. dropped by the engine after
# stall_timeout_s without progress (measured: a get from a SIGSTOPped holder answers -800).
# -900/-901: the master restarted or was slow since the lookup.
RETRYABLE = frozenset({-707, -800, -900, -901})


class StoreError(RuntimeError):
    pass


def describe(code: int) -> str:
    return f"{code} ({CODES[code]})" if code in CODES else str(code)


MASTER_UNREACHABLE = -900


class MasterAway:
    """After a call answered "master unreachable", calls are not made for ``quiet_s`` (1 s,
    doubling up to 16 s while the master stays away); a call that gets through resets it."""

    FIRST_QUIET_S, MAX_QUIET_S = 1.0, 16.0

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._until = 0.0
        self._quiet_s = 0.0

    def away(self) -> bool:
        with self._lock:
            return self._clock() < self._until

    def record(self, codes: Sequence[int]) -> None:
        with self._lock:
            if MASTER_UNREACHABLE in codes:
                self._quiet_s = min(2 * self._quiet_s or self.FIRST_QUIET_S, self.MAX_QUIET_S)
                self._until = self._clock() + self._quiet_s
            else:
                self._quiet_s = 0.0


class PoolStore:
    """One store client: mounts ``segment_bytes`` into the pool (0: a lookup-only client)."""

    def __init__(self, settings: PoolSettings, segment_bytes: int, buffer_bytes: int):
        # The store's transfer engine reads these once, at setup.
        for k, v in settings.engine_env().items():
            os.environ.setdefault(k, v)
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        threads_before = native_threads()
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            settings.local_hostname,
            settings.metadata_server,
            segment_bytes,
            buffer_bytes,
            settings.protocol,
            settings.device_name,
            settings.master_server_address,
        )
        # The client's threads move the bytes and keep its master lease alive; behind vLLM's
        # busy-waiting workers they waited for a CPU (a get blocked 22 s, the master expired idle
        # clients that missed heartbeats for 10 s). As for the P2P engine's threads on TCP: real
        # time where allowed. They sleep when idle (measured); the get's own spin is on our thread.
        started = [t for t in native_threads() if t not in threads_before]
        adopt_native_threads(started, "mc-store", realtime=settings.protocol == "tcp")
        if rc != 0:
            raise StoreError(
                f"Mooncake Store setup failed ({describe(rc)}) with master_server_address="
                f"{settings.master_server_address!r}, "
                f"metadata_server={redact_url(settings.metadata_server)!r}"
                f", global_segment_size={segment_bytes}: check both servers run and the sizes"
            )
        self._registered: list[int] = []
        self._master = MasterAway()
        # Puts land in this client's own segment where there is room: a local copy.
        self._put_config = ReplicateConfig()
        if segment_bytes:
            self._put_config.preferred_segment = self._store.get_hostname()

    def _ask(self, call, keys: Sequence[str], *args, always: bool = False) -> list[int]:
        """``call(keys, *args)`` per key, or -900 for every key while the master is away
        (unless ``always``)."""
        if not keys:
            return []
        if self._master.away() and not always:
            return [MASTER_UNREACHABLE] * len(keys)
        codes = list(call(list(keys), *args))
        self._master.record(codes)
        return codes

    def register(self, addr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(addr, nbytes)
        if rc != 0:
            raise StoreError(f"register_buffer({addr:#x}, {nbytes}) failed: {describe(rc)}")
        self._registered.append(addr)

    def exists(self, keys: Sequence[str]) -> list[int]:
        """1 or 0 per key, or a negative code."""
        return self._ask(self._store.batch_is_exist, keys)

    def put(self, keys: Sequence[str], ranges: Sequence[tuple[list[int], list[int]]]) -> list[int]:
        """``ranges[i]`` = (addresses, sizes) of key ``i``'s value; 0 or a negative code each."""
        return self._ask(
            self._store.batch_put_from_multi_buffers,
            keys,
            [r[0] for r in ranges],
            [r[1] for r in ranges],
            self._put_config,
        )

    def get(self, keys: Sequence[str], ranges: Sequence[tuple[list[int], list[int]]]) -> list[int]:
        """Bytes read per key, or a negative code."""
        return self._ask(
            self._store.batch_get_into_multi_buffers,
            keys,
            [r[0] for r in ranges],
            [r[1] for r in ranges],
            always=True,
        )

    def close(self) -> None:
        for addr in self._registered:
            try:
                self._store.unregister_buffer(addr)
            except Exception as e:  # closing anyway
                logger.debug("unregister_buffer(%#x): %s", addr, e)
        self._registered = []
        try:
            self._store.close()
        except Exception as e:
            logger.debug("store close: %s", e)
