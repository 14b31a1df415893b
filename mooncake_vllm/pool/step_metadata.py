"""What the pool's halves tell each other each step (scheduler → workers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request and one KV cache group between the pool and vLLM's KV cache: the
    value of ``digests[i]`` (every rank appends its own rank to the key, and the group where
    the model has several: ``pool.keys.pool_key``) is local block ``block_ids[i]``. A load of a
    hybrid model is one per group. ``error``: a load that could not be planned, reported
    failed by the workers with that reason."""

    req_id: str
    digests: list[str]
    block_ids: list[int]
    group: int = 0
    error: str | None = None


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    # Get from the pool, asynchronously; vLLM waits for each in finished_recving.
    loads: list[BlockTransfer] = field(default_factory=list)
    # Put into the pool before this step ends (wait_for_save): blocks this step completes.
    saves: list[BlockTransfer] = field(default_factory=list)
