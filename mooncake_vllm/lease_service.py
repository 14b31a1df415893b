"""The producer's leases and side channels, served from the engine-core process (scheduler half).

Why here and not in the workers: the engine core is where ``request_finished`` decides to hold a
prompt's blocks, so the lease exists before the handoff leaves the process (an ``Acquire`` never
waits for a step), and this process is idle while its workers compute, so acquires are answered
in microseconds even when a worker is deep in a long prefill. The workers only register their KV
memory (the layout reaches us through vLLM's handshake metadata) and report the requests whose
leases ended as finished-sending, which frees the blocks (``MooncakeConnectorMetadata``).

One side channel per TP rank. Per-head K/V is sharded by rank: one ``LeaseTable`` per rank,
consumer rank r pulls rank r's shard and releases it, and a request's blocks are freed once every
rank's lease has ended. An MLA latent is replicated (every rank holds all of it): one table for all
ranks, each consumer rank pulls the latent once from one producer rank
(``planning.producer_rank_for``), and the request's blocks — on every producer rank — are freed
when all consumer ranks have released it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from mooncake_vllm.config import ConnectorConfig
from mooncake_vllm.leases import LeaseTable
from mooncake_vllm.protocol import MemSegment
from mooncake_vllm.side_channel import SideChannelServer

logger = logging.getLogger(__name__)

# Test hook (tests/test_new_user_setup.py): freeze the producer's worker once the lease of a
# transfer whose id starts with this prefix is granted, before the grant is sent (so no read can
# beat the freeze), as a producer stopped mid-pull would. Unset: off.
_FREEZE_PREFIX = os.environ.get("MOONCAKE_VLLM_TEST_FREEZE_AFTER_GRANT", "")


@dataclass(frozen=True)
class RankLayout:
    """Where one producer rank's blocks are: its transfer-engine segment and memory layout."""

    te_segment: str
    segments: list[MemSegment]
    worker_pid: int

    @property
    def bytes_per_block(self) -> int:
        return sum(s.block_len for s in self.segments)


class LeaseService:
    def __init__(
        self, cfg: ConnectorConfig, on_end: Callable[[], None], kv_replicated: bool = False
    ):
        s = cfg.settings
        self._tp_size = cfg.tp_size
        self._lock = threading.Lock()
        self._ended_ranks: Counter[str] = Counter()  # req id -> tables whose lease ended
        self._layouts: dict[int, RankLayout] = {}
        self._tables = [
            LeaseTable(
                ttl_s=s.lease_ttl_s,
                budget_bytes=s.kv_buffer_size,
                # A pinned lease outlives the consumer's whole pull: its last attempt ends by the
                # deadline plus one stall timeout.
                pull_hold_s=s.load_timeout_s + s.stall_timeout_s + 5.0,
                on_end=on_end,
            )
            for _ in range(1 if kv_replicated else cfg.tp_size)
        ]
        # The table serving each rank's side channel (the one shared table when replicated).
        self._table_of_rank = [self._tables[r % len(self._tables)] for r in range(cfg.tp_size)]
        self._servers: list[SideChannelServer] = []
        self._reported_dead = False
        try:
            for rank, table in enumerate(self._table_of_rank):
                self._servers.append(
                    SideChannelServer(
                        cfg.host,
                        cfg.side_channel_port(rank),
                        table,
                        layout=lambda r=rank: self._layout(r),
                        on_grant=self._freeze_hook(rank) if _FREEZE_PREFIX else None,
                    )
                )
        except BaseException:
            self.close()
            raise

    def set_layouts(self, layouts: dict[int, RankLayout]) -> None:
        missing = set(range(self._tp_size)) - set(layouts)
        if missing:
            raise RuntimeError(f"no KV layout from producer worker rank(s) {sorted(missing)}")
        self._layouts = dict(layouts)

    def _layout(self, rank: int) -> tuple[str, list[MemSegment]]:
        layout = self._layouts[rank]
        return layout.te_segment, layout.segments

    @property
    def addresses(self) -> list[str]:
        return [srv.address for srv in self._servers]

    def hold(self, req_id: str, transfer_id: str, block_ids: list[int]) -> bool:
        """Opens the lease on every rank; False (nothing held) if a side channel is down, since
        no consumer could pull it."""
        dead = [srv.address for srv in self._servers if not srv.alive]
        if dead:
            if not self._reported_dead:
                self._reported_dead = True
                logger.error(
                    "the side channel thread at %s has ended; finished prefills are no longer "
                    "handed over (their decodes compute the prompt). Restart this vLLM",
                    dead,
                )
            return False
        for rank, table in enumerate(self._tables):  # a shared table: rank 0's bytes per rank
            nbytes = len(block_ids) * self._layouts[rank].bytes_per_block
            table.add(req_id, transfer_id, block_ids, nbytes)
        return True

    def take_finished(self) -> set[str]:
        """Requests whose lease has ended in every table: their blocks can be freed."""
        done = set()
        with self._lock:
            for table in self._tables:
                for req_id in table.take_finished():
                    self._ended_ranks[req_id] += 1
                    if self._ended_ranks[req_id] == len(self._tables):
                        del self._ended_ranks[req_id]
                        done.add(req_id)
        return done

    def take_ended_counts(self) -> dict[str, int]:
        """Leases ended since the last call, by reason (counted on rank 0 only)."""
        return self._tables[0].take_ended_counts()

    @property
    def held_count(self) -> int:
        return self._tables[0].held_count

    @property
    def held_bytes(self) -> int:
        """KV bytes held on all ranks (a shared table's leases are held on every rank)."""
        per_table_ranks = self._tp_size // len(self._tables)
        return per_table_ranks * sum(table.held_bytes for table in self._tables)

    def _freeze_hook(self, rank: int) -> Callable[[str], None]:
        def freeze(transfer_id: str) -> None:
            if transfer_id.startswith(_FREEZE_PREFIX):
                os.kill(self._layouts[rank].worker_pid, signal.SIGSTOP)

        return freeze

    def close(self) -> None:
        for srv in self._servers:
            srv.close()
