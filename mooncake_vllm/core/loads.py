"""What both connectors' loads share: destination blocks pinned in vLLM's block pool until every
worker rank reports the load settled, and the worker's report of settled loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock


# A load not done this long after its deadline is reported failed without waiting for its
# thread (its blocks stay pinned until the thread has returned).
REPORT_AFTER_S = 0.25


@dataclass
class MooncakeWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler: loads whose transfer-engine entries have all ended on this rank, so
    no write can land in their blocks any more (the scheduler half unpins them once every rank
    has said so). One list element per rank and load."""

    settled: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> MooncakeWorkerMeta:
        assert isinstance(other, MooncakeWorkerMeta)
        self.settled.extend(other.settled)
        return self

    @classmethod
    def of(cls, settled: list[str]) -> MooncakeWorkerMeta | None:
        """The report of ``settled`` (None when there is nothing to report)."""
        return cls(list(settled)) if settled else None


class BlockPins:
    """Blocks under a pull, held with one extra reference in vLLM's block pool until every TP
    rank has reported the load settled (see the module docstring)."""

    def __init__(self, pool: BlockPool, tp_size: int):
        self._pool, self._tp_size = pool, tp_size
        self._pinned: dict[str, tuple[list[KVCacheBlock], int]] = {}  # → (blocks, ranks left)

    def pin(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        blocks = [self._pool.blocks[b] for b in block_ids]
        self._pool.touch(blocks)
        self._pinned[req_id] = (blocks, self._tp_size)

    def settle(self, req_ids: list[str]) -> None:
        """One element per rank that settled a load; the last rank unpins its blocks."""
        for req_id in req_ids:
            if (pinned := self._pinned.pop(req_id, None)) is None:
                continue
            blocks, ranks_left = pinned
            if ranks_left > 1:
                self._pinned[req_id] = (blocks, ranks_left - 1)
            else:
                self._pool.free_blocks(reversed(blocks))

    def __len__(self) -> int:
        return len(self._pinned)
