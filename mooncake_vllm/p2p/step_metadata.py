"""What the halves tell each other each step: scheduler → workers (vLLM's connector metadata)
and workers → scheduler (``core.loads.MooncakeWorkerMeta``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from mooncake_vllm.p2p.protocol import Handoff, HandoffChecks, PendingHandoff


@dataclass(frozen=True)
class GroupLoad:
    """A hybrid model's KV cache group beyond the first: its blocks to fill, from
    ``first_token`` on (``core.kv_groups.positions_to_fill``); the producer's are the
    handoff's ``group_block_ids``."""

    local_block_ids: list[int]
    first_token: int = 0


@dataclass(frozen=True)
class LoadSpec:
    """Pull prompt tokens from ``first_token`` on (where the local prefix cache stops) into
    ``local_block_ids`` for one consumer request; ``remote_block_ids`` are all the producer's
    blocks of the prompt (``planning.plan_pull`` maps tokens across block sizes).

    ``error`` set: the handoff was rejected by the scheduler; the worker reports the load as
    failed so vLLM's ``kv_load_failure_policy`` decides. ``local_block_ids`` empty with no error:
    the local prefix cache already holds everything; only release the producer's lease.

    A ``PendingHandoff`` (``--dispatch concurrent``): the producer's blocks are not known yet;
    the worker's acquire waits for the prefill, and the handoff its grant carries is checked
    with ``checks`` before a byte moves.
    """

    req_id: str
    handoff: Handoff | PendingHandoff | None
    remote_block_ids: list[int]
    local_block_ids: list[int]
    error: str | None = None
    first_token: int = 0
    checks: HandoffChecks | None = None
    # KV cache groups 1.. of a hybrid model (``local_block_ids`` and ``first_token`` are group
    # 0's); empty for a model of one group.
    groups: list[GroupLoad] = field(default_factory=list)
    # The tokens loaded end here, short of the prompt (``kv_groups.claim_hold_back``); 0: the
    # whole prompt.
    end_token: int = 0
    # The request's trace context (``traceparent``), with tracing on: the pull's spans go under
    # it (``core.tracing``); {}: no spans.
    trace: dict[str, str] = field(default_factory=dict)

    @property
    def prompt_digest(self) -> str:
        """The request's prompt digest, where ``checks`` carry it (a pending handoff's acquire
        names it, so a lease of another prompt is not granted); "" otherwise."""
        return self.checks.prompt_digest if self.checks is not None else ""

    @property
    def fills_blocks(self) -> bool:
        """Whether the pull writes any local block (vLLM waits for its outcome)."""
        return bool(self.local_block_ids) or any(g.local_block_ids for g in self.groups)

    @property
    def num_blocks(self) -> int:
        return len(self.local_block_ids) + sum(len(g.local_block_ids) for g in self.groups)


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    # Producer: requests whose leases ended on every rank; workers report them finished-sending
    # (which frees their blocks) in this same step.
    finished_sending: set[str] = field(default_factory=set)
    # Consumer: requests vLLM finished (aborted) while their pending pull waits for its prefill:
    # the workers withdraw the wait, so the load settles and the blocks are freed.
    cancelled: set[str] = field(default_factory=set)
    # Producer (``layerwise_handoff``): transfers whose prompts this step completes; workers
    # mark each layer written (``leases.process.LayerDone``, carrying ``layers_token``).
    layer_marks: list[str] = field(default_factory=list)
    layers_token: bytes = b""
