"""The pool's scheduler half: runs in vLLM's engine-core process, decides, never moves KV.

Load (``kv_consumer``, ``kv_both``): ``get_num_new_matched_tokens`` asks the pool, in one batched
existence check bounded by ``lookup_timeout_s``, how many of the prompt's blocks beyond the
local prefix cache it holds (every TP rank's key), and claims them as an asynchronous load;
``update_state_after_alloc`` names the destination blocks. A lookup that fails or times out
counts as a miss: the prompt is computed here, never failed.

Save (``kv_producer``, ``kv_both``): every step, ``build_connector_meta`` tells the workers which
prompt blocks that step completes (full blocks as they fill, the trailing partial block once the
whole prompt is computed). The workers put them before the step ends (``wait_for_save``), i.e.
before vLLM can emit the request's first token, so a finished prefill's prompt is in the pool
before its response leaves the server.

Keys: a block's key covers its tokens, every token before it and what else decides its KV (the
LoRA adapter, multimodal inputs, ``cache_salt``: ``core.prompt_identity``), read from the vLLM
``Request``. The save path sees a request as vLLM's ``NewRequestData``, which lacks
``cache_salt``, so the identity is taken from the ``Request`` in ``update_state_after_alloc``
(vLLM calls it for every request it schedules from the waiting queue, in the same step) and a
request whose identity was not seen is not saved. A prompt of embeddings has no key at all.

Hybrid models (a KV cache group per kind of attention, ``core.kv_groups``): each group's blocks
have keys of their own. A lookup counts the leading blocks every full-attention group holds and,
for a sliding-window group, only the blocks the window of the first token to compute reaches; a
load fills, per group, the blocks vLLM allocated (``positions_to_fill``: for a sliding group, the
window's). The claim leaves the last prompt token to compute, as the pair's does
(``claim_hold_back``). Saves skip the null block (a window's freed positions).

Late writes: a get cannot be cancelled; one reported failed at its deadline may still write. Its
destination blocks stay pinned in vLLM's block pool until every rank reports it settled (the P2P
connector's ``BlockPins``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mooncake_vllm.core.kv_groups import (
    NULL_BLOCK_ID,
    KVGroup,
    claim_hold_back,
    first_attended,
    positions_to_fill,
)
from mooncake_vllm.core.loads import BlockPins, MooncakeWorkerMeta
from mooncake_vllm.core.prompt_identity import PromptIdentity, prompt_identity
from mooncake_vllm.p2p.local_channels import WakeForwarder
from mooncake_vllm.pool.config import PoolSettings
from mooncake_vllm.pool.keys import block_keys, chain_digests, group_key, key_ranks, leading_hits
from mooncake_vllm.pool.stats import PoolStats
from mooncake_vllm.pool.step_metadata import BlockTransfer, PoolConnectorMetadata
from mooncake_vllm.vllm_glue import IDLE_STEP_PAUSE_S, EngineCoreHandle, Rests

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from mooncake_vllm.pool.store import PoolStore

logger = logging.getLogger(__name__)


@dataclass
class _Planned:
    """A load claimed by ``get_num_new_matched_tokens``, waiting for its blocks."""

    first_block: int
    digests: list[str]  # of the blocks to load, from first_block on


@dataclass
class _Saving:
    """A prompt whose blocks are being saved as they are computed."""

    digests: list[str]
    prompt_len: int
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    computed: int = 0  # prompt tokens whose KV exists once the scheduled step has run
    saved_blocks: int = 0  # leading blocks already handed to the workers (or loaded)


class PoolSchedulerHalf:
    def __init__(
        self,
        settings: PoolSettings,
        *,
        is_producer: bool,
        is_consumer: bool,
        block_size: int,
        salt: str,
        tp_size: int,
        store: PoolStore | None,
        kv_replicated: bool = False,
        engine_core: EngineCoreHandle | None = None,
        wake_endpoint: str | None = None,
        kv_groups: tuple[KVGroup, ...] = (KVGroup(()),),
    ):
        """``kv_replicated``: every TP rank holds the same KV (MLA), stored once in the pool.
        ``engine_core`` and ``wake_endpoint`` (where the workers say a load ended): while only
        loads are pending, vLLM rests instead of stepping (``vllm_glue.Rests``). ``kv_groups``:
        the engine's KV cache groups (``core.kv_groups``)."""
        self._settings = settings
        self._is_producer, self._is_consumer = is_producer, is_consumer
        self._block_size, self._salt, self._tp_size = block_size, salt, tp_size
        self._key_ranks = key_ranks(tp_size, kv_replicated)
        self._groups = kv_groups
        self._hold_back = claim_hold_back(kv_groups)
        self._store = store  # lookup-only client (consumers)
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="mooncake-pool-lookup")
        self._lookup: Future | None = None  # the last lookup (a stuck one blocks the next)
        self._planned: dict[str, _Planned] = {}
        self._loads: list[BlockTransfer] = []
        # Requests whose load was planned (never again) → blocks from the prompt start it covers.
        self._loaded: dict[str, int] = {}
        self._saving: dict[str, _Saving] = {}
        # Requests allocated this step → their identity (None: no key), for ``_track``.
        self._identities: dict[str, PromptIdentity | None] = {}
        self._pins: BlockPins | None = None
        self._stats = PoolStats()
        self._rests = Rests(engine_core)
        self._waker: WakeForwarder | None = None
        if engine_core is not None and wake_endpoint is not None and is_consumer:
            try:
                self._waker = WakeForwarder(wake_endpoint, self._rests.wake)
            except Exception as e:  # zmq.ZMQError: the endpoint is taken; steps are paused
                logger.info("pool loads will not rest vLLM (%s: %s)", wake_endpoint, e)
        if is_consumer:
            logger.info(
                "while only pool loads are pending vLLM %s",
                "rests until one ends" if self._waker else f"steps every {IDLE_STEP_PAUSE_S}s",
            )

    # ---- load ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self._is_consumer or self._store is None or request.request_id in self._loaded:
            return 0, False
        identity = prompt_identity(request)
        prompt = request.prompt_token_ids or []
        if identity is None or not prompt:
            return 0, False
        digests = chain_digests(prompt, self._block_size, self._salt, identity)
        first = num_computed_tokens // self._block_size
        wanted = digests[first:]
        limit = len(prompt) - self._hold_back
        if not wanted or limit <= num_computed_tokens:
            return 0, False
        hits = self._count_hits(wanted, first, limit)
        self._stats.count("hit_blocks", hits)
        self._stats.count("miss_blocks", len(wanted) - hits)
        count = min(limit, (first + hits) * self._block_size) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._planned[request.request_id] = _Planned(first, wanted[:hits])
        return count, True

    def _count_hits(self, digests: list[str], first: int, limit: int) -> int:
        """Leading blocks (from block ``first``) the pool holds for a load of at most ``limit``
        prompt tokens; 0 when the pool does not answer in time."""
        self._stats.count("lookups")
        if self._lookup is not None and not self._lookup.done():
            self._stats.count("lookup_failures")  # the previous one is stuck: do not queue
            return 0
        n = len(self._groups)
        keys = [
            k
            for g in range(n)
            for r in range(self._key_ranks)
            for k in block_keys(digests, r, group_key(g, n))
        ]
        self._lookup = self._lookups.submit(self._store.exists, keys)
        try:
            exists = self._lookup.result(timeout=self._settings.lookup_timeout_s)
            return self._usable_hits(exists, len(digests), first, limit)
        except FutureTimeout:
            logger.warning(
                "pool lookup not answered in %gs (lookup_timeout_s): counted as a miss",
                self._settings.lookup_timeout_s,
            )
        except Exception as e:
            logger.warning("pool lookup failed (%s): counted as a miss", e)
        self._stats.count("lookup_failures")
        return 0

    def _usable_hits(self, exists: list[int], num: int, first: int, limit: int) -> int:
        """From ``exists`` (group-major, then rank-major, ``num`` blocks each): the leading
        blocks every rank of every full-attention group holds, cut back until each
        sliding-window group holds every block the window of the load's end reaches."""
        per_group = num * self._key_ranks
        answers = [exists[g * per_group : (g + 1) * per_group] for g in range(len(self._groups))]
        groups = list(zip(answers, self._groups, strict=True))
        full = [a for a, group in groups if not group.sliding_window]
        hits = min((leading_hits(a, num, self._key_ranks) for a in full), default=num)
        bs = self._block_size
        while hits > 0:
            end = min(limit, (first + hits) * bs)
            last = -(-end // bs) - first  # blocks of the load, from ``first``
            if all(
                all(
                    a[r * num + i] == 1
                    for r in range(self._key_ranks)
                    for i in range(max(0, first_attended(group, end, bs) - first), last)
                )
                for a, group in groups
                if group.sliding_window
            ):
                return hits
            hits -= 1
        return 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._is_producer:
            self._identities[request.request_id] = prompt_identity(request)
        planned = self._planned.pop(request.request_id, None)
        if planned is None or num_external_tokens == 0:
            return
        req_id = request.request_id
        bs = self._block_size
        end_token = planned.first_block * bs + num_external_tokens
        try:
            loads = self._plan_load(req_id, planned, blocks, end_token)
        except Exception as e:
            # Never into vLLM's scheduler; the claimed load must still end (vLLM waits for it).
            logger.exception("request %s: pool load not planned, connector error", req_id)
            ids = [b.block_id for b in blocks.blocks[0][planned.first_block :]]
            loads = [BlockTransfer(req_id, [], ids, error=f"connector error: {e!r}")]
        self._loads += loads
        if self._pins is not None:
            self._pins.pin(req_id, [b for load in loads for b in load.block_ids])
        self._loaded[req_id] = -(-end_token // bs)  # need not be saved again

    def _plan_load(
        self, req_id: str, planned: _Planned, blocks: KVCacheBlocks, end_token: int
    ) -> list[BlockTransfer]:
        """Per group, the blocks vLLM allocated for the tokens up to ``end_token`` and the
        digests of their values in the pool."""
        loads = []
        for g, group in enumerate(self._groups):
            start, ids = positions_to_fill(blocks.blocks[g], group, end_token, self._block_size)
            lo = start - planned.first_block
            digests = planned.digests[lo : lo + len(ids)] if lo >= 0 else []
            if len(digests) != len(ids):
                covered = planned.first_block + len(planned.digests) - 1
                raise ValueError(
                    f"KV cache group {g}: blocks {start}..{start + len(ids) - 1} to fill, the "
                    f"lookup covered {planned.first_block}..{covered}"
                )
            loads.append(BlockTransfer(req_id, digests, ids, g))
        return loads

    def bind_block_pool(self, pool: BlockPool) -> None:
        if self._is_consumer:
            self._pins = BlockPins(pool, self._tp_size)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if self._pins is not None and isinstance(meta, MooncakeWorkerMeta):
            self._pins.settle(meta.settled)

    def has_pending_work(self) -> bool:
        return bool(self._pins)

    # ---- save ----------------------------------------------------------------------------

    def _track(self, scheduler_output: SchedulerOutput) -> None:
        """Follow every scheduled prompt's blocks and computed length."""
        scheduled = scheduler_output.num_scheduled_tokens
        # This step's admissions; one not among the new requests was a resumed one, whose
        # saving goes on as it was.
        identities, self._identities = self._identities, {}
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids or []
            identity = identities.get(new.req_id)
            if not prompt or identity is None:
                continue
            digests = chain_digests(prompt, self._block_size, self._salt, identity)
            saving = _Saving(digests, len(prompt))
            saving.block_ids = [list(ids) for ids in new.block_ids]
            saving.saved_blocks = self._loaded.get(new.req_id, 0)
            saving.computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._saving[new.req_id] = saving
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            saving = self._saving.get(req_id)
            if saving is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    saving.block_ids = [list(ids) for ids in new_ids]
                else:
                    for have, more in zip(saving.block_ids, new_ids, strict=True):
                        have.extend(more)
            saving.computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)

    def _saves(self, scheduler_output: SchedulerOutput) -> list[BlockTransfer]:
        self._track(scheduler_output)
        saves, done = [], []
        bs = self._block_size
        for req_id, s in self._saving.items():
            computed = min(s.computed, s.prompt_len)
            end = computed // bs
            if computed == s.prompt_len and s.prompt_len % bs:
                end += 1  # the trailing partial block, once the whole prompt is in it
            end = min(end, *(len(ids) for ids in s.block_ids))
            if end > s.saved_blocks:
                for g, ids in enumerate(s.block_ids):
                    # A null block: a window's position freed before it was saved (a local
                    # prefix-cache hit there); nothing of it to put.
                    todo = [
                        (d, b)
                        for d, b in zip(
                            s.digests[s.saved_blocks : end], ids[s.saved_blocks : end], strict=True
                        )
                        if b != NULL_BLOCK_ID
                    ]
                    if todo:
                        digests, block_ids = (list(x) for x in zip(*todo, strict=True))
                        saves.append(BlockTransfer(req_id, digests, block_ids, g))
                s.saved_blocks = end
            if s.saved_blocks >= len(s.digests):
                done.append(req_id)
        for req_id in done:
            del self._saving[req_id]
        return saves

    # ---- every step ----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PoolConnectorMetadata:
        meta = PoolConnectorMetadata(loads=self._loads)
        self._loads = []
        if self._is_producer:
            meta.saves = self._saves(scheduler_output)
        idle = not (meta.loads or meta.saves or scheduler_output.total_num_scheduled_tokens)
        if idle and self._pins:
            engine_core = self._rests.engine_core  # not None where there is a waker
            if self._waker is None or engine_core is None:
                time.sleep(IDLE_STEP_PAUSE_S)  # waiting for a load: do not spin a core
            elif not scheduler_output.finished_req_ids and not engine_core.busy_with_others():
                # Nothing can run until a load ends. Stepping every 2 ms instead kept the
                # worker's queue reader spinning (each step wakes it) beside the get's own
                # spinning thread: a waiting decode took both cores of a 2-core host, and the
                # holder's store threads, in another engine, got none (docs/pool.md, Stalls).
                self._rests.rest()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are never held for the pool: saves end within the step that computed them."""
        req_id = request.request_id
        self._saving.pop(req_id, None)
        self._identities.pop(req_id, None)
        self._planned.pop(req_id, None)
        self._loaded.pop(req_id, None)
        return False, None

    def get_stats(self) -> PoolStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, PoolStats()
        return out

    def shutdown(self) -> None:
        if self._waker is not None:
            self._waker.close()
        self._lookups.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            self._store.close()
