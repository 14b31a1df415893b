"""The pool's worker half: runs in every vLLM worker process and moves the KV.

Setup: mounts ``global_segment_size`` of this process's DRAM into the pool and registers the KV
cache tensors with the store, so puts read from and gets write into vLLM's blocks directly. One
block's value in the pool is that block of every layer's K and V (every segment of
``planning.tensor_segments``, in layer-name order), laid end to end; for a hybrid model, of every
layer of the block's KV cache group (``core.kv_groups``), under that group's key.

Save: ``wait_for_save`` — called by vLLM after the step's forward pass, before the step's output
leaves the worker — asks the pool which of the step's completed blocks it lacks and puts those.
A put that fails (pool full, master away) is logged and counted; the request is unaffected.

Load: each load is one job on a small thread pool, off the forward path; its outcome is collected
by ``get_transfer_results`` on the step thread. A get that fails, or is not done within
``load_timeout_s``, is reported in ``failed_recving`` and vLLM's ``kv_load_failure_policy``
decides. The store cannot cancel a get, so a job reported at its deadline keeps its blocks pinned
(by the scheduler half) until its thread returns and this worker reports it settled
(``core.loads.LoadJobs``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from mooncake_vllm.core.kv_groups import KVGroup, group_segments
from mooncake_vllm.core.loads import LoadJob, LoadJobs, LoadOutcome, MooncakeWorkerMeta
from mooncake_vllm.core.os_threads import name_this_thread, unpin
from mooncake_vllm.core.planning import MemSegment, kv_cache_regions
from mooncake_vllm.core.worker_stats import WorkerStats
from mooncake_vllm.p2p.local_channels import WakeSender
from mooncake_vllm.pool.config import PoolSettings
from mooncake_vllm.pool.keys import block_keys, group_key, key_rank
from mooncake_vllm.pool.stats import PoolStats
from mooncake_vllm.pool.step_metadata import BlockTransfer, PoolConnectorMetadata
from mooncake_vllm.pool.store import RETRYABLE, PoolStore, describe

logger = logging.getLogger(__name__)

_LOAD_THREADS = 4
_WARN_EVERY_S = 10.0
# First pause before a get is asked again; it doubles each time.
_RETRY_PAUSE_S = 0.05


def _init_get_thread() -> None:
    """A get spins its thread until the holder has served it (``pool.store``): not on the core
    vLLM bound the worker's main thread to, where the holder's own store threads may be."""
    name_this_thread("mc-pool-get")
    unpin()


def block_ranges(segments: list[MemSegment], block_id: int) -> tuple[list[int], list[int]]:
    """Addresses and sizes of one block's value: the block in every segment, in order."""
    return (
        [s.base_addr + block_id * s.block_stride for s in segments],
        [s.block_len for s in segments],
    )


class PoolWorkerHalf:
    def __init__(
        self,
        settings: PoolSettings,
        *,
        is_producer: bool,
        is_consumer: bool,
        tp_rank: int,
        num_blocks: int,
        kv_replicated: bool = False,
        wake_endpoint: str | None = None,
        kv_groups: tuple[KVGroup, ...] = (KVGroup(()),),
    ):
        """``kv_replicated``: every TP rank holds the same KV (MLA): rank 0 alone puts it, once
        per engine, and every rank gets that copy. ``kv_groups``: the engine's KV cache
        groups."""
        self._settings = settings
        self._is_producer, self._is_consumer = is_producer, is_consumer
        self._tp_rank, self._num_blocks = tp_rank, num_blocks
        self._key_rank = key_rank(tp_rank, kv_replicated)
        self._puts_blocks = self._key_rank == tp_rank
        self._store: PoolStore | None = None
        self._groups = kv_groups
        self._segments: list[list[MemSegment]] = []  # per group: its layers' segments
        self._block_bytes: list[int] = []  # per group: one block's value
        self._stats = WorkerStats(PoolStats)
        self._pool = ThreadPoolExecutor(
            _LOAD_THREADS, thread_name_prefix="mooncake-pool-get", initializer=_init_get_thread
        )
        # A load that ends wakes the scheduler half, which rests vLLM while loads are pending.
        self._wake = WakeSender(wake_endpoint) if wake_endpoint and is_consumer else None
        wake = self._wake.wake if self._wake is not None else None
        self._jobs: LoadJobs[LoadOutcome] = LoadJobs(self._pool, wake=wake)
        self._saves: list[BlockTransfer] = []
        self._last_put_warning = -_WARN_EVERY_S

    # ---- setup ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        owners: list[str] = []
        segments, tensors = kv_cache_regions(kv_caches, self._num_blocks, owners=owners)
        storages = {addr: nbytes for addr, (nbytes, _) in tensors.items()}
        picks = group_segments(self._groups, owners)
        self._segments = [[segments[i] for i in pick] for pick in picks]
        self._block_bytes = [sum(s.block_len for s in segs) for segs in self._segments]
        s = self._settings
        self._store = PoolStore(s, s.global_segment_size, s.local_buffer_size)
        for addr, nbytes in sorted(storages.items()):
            self._store.register(addr, nbytes)
        logger.info(
            "MooncakeStoreConnector worker rank %d: %d layers, %d segments, %s B/block; "
            "mounted %d B into the pool at %s",
            self._tp_rank,
            len(kv_caches),
            len(segments),
            "/".join(map(str, self._block_bytes)),
            s.global_segment_size,
            s.master_server_address,
        )

    def _parts(self, transfers: list[BlockTransfer]) -> tuple[list[str], list, list[int]]:
        """The keys of ``transfers``' blocks on this rank, their ranges in vLLM's KV cache, and
        each value's size."""
        keys: list[str] = []
        ranges: list[tuple[list[int], list[int]]] = []
        sizes: list[int] = []
        for t in transfers:
            keys += block_keys(t.digests, self._key_rank, group_key(t.group, len(self._groups)))
            ranges += [block_ranges(self._segments[t.group], b) for b in t.block_ids]
            sizes += [self._block_bytes[t.group]] * len(t.block_ids)
        return keys, ranges, sizes

    # ---- save ----------------------------------------------------------------------------

    def start_load_kv(self, meta: PoolConnectorMetadata) -> None:
        self._saves = list(meta.saves)
        loads: dict[str, list[BlockTransfer]] = {}  # a hybrid model's: one per group
        for load in meta.loads:
            loads.setdefault(load.req_id, []).append(load)
        for req_id, parts in loads.items():
            job = partial(self._load, req_id, parts)
            self._jobs.submit(req_id, job, self._settings.load_timeout_s)

    def wait_for_save(self) -> None:
        """Put this step's completed blocks that the pool lacks; never raises."""
        saves, self._saves = self._saves, []
        if not saves or self._store is None or not self._puts_blocks:
            return
        start = time.monotonic()
        keys, ranges, sizes = self._parts(saves)
        try:
            exists = self._store.exists(keys)
        except Exception as e:
            logger.warning("pool existence check before a put failed (%s): putting all", e)
            exists = [0] * len(keys)
        todo = [i for i, e in enumerate(exists) if e != 1]
        skipped = len(keys) - len(todo)
        if any(e < 0 for e in exists):
            # The master did not answer (-900 comes at once): a put would spend seconds
            # reconnecting inside this step, delaying every request in it. Count and move on.
            self._count_put(0, 0, skipped, len(todo), start)
            self._warn_put(f"unreachable ({describe(min(exists))}): {len(todo)} blocks not put")
            return
        try:
            codes = self._store.put([keys[i] for i in todo], [ranges[i] for i in todo])
        except Exception as e:
            codes = [str(e)] * len(todo)
        bad = [c for c in codes if c != 0]
        if bad:
            first = describe(bad[0]) if isinstance(bad[0], int) else bad[0]
            self._warn_put(f"put of {len(bad)} of {len(todo)} blocks failed (first: {first})")
        nbytes = sum(sizes[i] for i, c in zip(todo, codes, strict=True) if c == 0)
        self._count_put(len(todo) - len(bad), nbytes, skipped, len(bad), start)

    def _count_put(self, put: int, nbytes: int, skipped: int, failed: int, start: float) -> None:
        with self._stats.update() as stats:
            stats.count("put_blocks", put)
            stats.count("put_bytes", nbytes)
            stats.count("put_skipped_blocks", skipped)
            stats.count("put_failures", failed)
            stats.sample("put_durations_s", time.monotonic() - start)

    def _warn_put(self, what: str) -> None:
        """At most one warning per ``_WARN_EVERY_S``: a full pool or an absent master would
        otherwise log every step."""
        now = time.monotonic()
        if now - self._last_put_warning >= _WARN_EVERY_S:
            self._last_put_warning = now
            logger.warning(
                "pool %s; those prompts are computed again where needed (the "
                "requests are unaffected)",
                what,
            )

    # ---- load ----------------------------------------------------------------------------

    def _load(
        self, req_id: str, loads: list[BlockTransfer], job: LoadJob[LoadOutcome]
    ) -> LoadOutcome:
        """Get the blocks of a request's loads (one per KV cache group); keys that failed in a
        way worth repeating (a get is idempotent) are asked again while the job's deadline is
        ahead. Never raises."""
        start, deadline = time.monotonic(), job.deadline_s
        try:
            if errors := [load.error for load in loads if load.error]:
                raise RuntimeError(errors[0])
            keys, ranges, sizes = self._parts(loads)
            todo = list(range(len(keys)))
            pause_s = _RETRY_PAUSE_S
            while True:
                results = self._store.get([keys[i] for i in todo], [ranges[i] for i in todo])
                failed = [(i, n) for i, n in zip(todo, results, strict=True) if n != sizes[i]]
                if not failed:
                    break
                i, n = failed[0]
                if any(n not in RETRYABLE for _, n in failed) or time.monotonic() >= deadline:
                    what = describe(n) if n < 0 else f"{n} B, expected {sizes[i]}"
                    raise RuntimeError(f"get of {keys[i]} returned {what}")
                logger.info(
                    "request %s: get of %d blocks returned %s; asking again",
                    req_id,
                    len(failed),
                    describe(n),
                )
                with self._stats.update() as stats:
                    stats.count("get_retries")
                todo = [i for i, _ in failed]
                time.sleep(min(pause_s, max(0.0, deadline - time.monotonic())))
                pause_s *= 2
            took = time.monotonic() - start
            return LoadOutcome(req_id, True, blocks=len(keys), nbytes=sum(sizes), duration_s=took)
        except Exception as e:
            return LoadOutcome(req_id, False, reason=f"{type(e).__name__}: {e}")

    def _overdue(self, job: LoadJob[LoadOutcome]) -> LoadOutcome:
        reason = (
            f"not done {self._settings.load_timeout_s:g}s (load_timeout_s) after "
            "it started; its blocks stay pinned until it has ended"
        )
        return LoadOutcome(job.req_id, False, reason=reason)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        for outcome in self._jobs.collect(self._overdue):
            results.finished_recving.add(outcome.req_id)
            with self._stats.update() as stats:
                if outcome.ok:
                    stats.count("loads")
                    stats.count("get_blocks", outcome.blocks)
                    stats.count("get_bytes", outcome.nbytes)
                    stats.sample("get_durations_s", outcome.duration_s)
                else:
                    logger.warning(
                        "request %s: load from the pool failed: %s", outcome.req_id, outcome.reason
                    )
                    results.failed_recving.add(outcome.req_id)
                    stats.count("load_failures")
        return results

    def build_worker_meta(self) -> MooncakeWorkerMeta | None:
        return self._jobs.worker_meta()

    def get_stats(self) -> PoolStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._wake is not None:
            self._wake.close()
            self._wake = None
        if self._store is not None:
            self._store.close()
            self._store = None
