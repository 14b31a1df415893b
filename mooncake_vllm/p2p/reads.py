"""A consumer rank's reads: a producer rank's grant read into this rank's blocks.

``Reader`` holds what the worker registered (the transfer engine, this rank's segments and their
layers and KV cache groups, the re-blocking staging buffer) and reads a grant: the regions
planned across TP and block sizes (``planning.plan_pull``), each KV cache group's blocks into
its own layers' segments, a pipeline stage's layers only, layer by layer while the prefill
computes (``layerwise_handoff``), or re-blocked through the staging buffer (``core.reblock``).
Which producer ranks a pull reads (``sources``) is decided here too, from the same layout.
``puller.Puller`` acquires and releases the leases around these reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mooncake_vllm.core.auth import host_allowed
from mooncake_vllm.core.kv_groups import GroupError, KVGroup, trim_to_remote
from mooncake_vllm.core.loads import LoadJob
from mooncake_vllm.core.os_threads import make_latency_critical, name_this_thread
from mooncake_vllm.core.planning import (
    PlanError,
    head_sources,
    lease_readers,
    plan_pull,
    producer_rank_for,
    rank_heads,
)
from mooncake_vllm.core.reblock import pull_through_staging
from mooncake_vllm.p2p.config import ConnectorConfig
from mooncake_vllm.p2p.protocol import (
    ALL_LAYERS,
    Granted,
    Handoff,
    MemSegment,
    Progress,
    Refused,
)
from mooncake_vllm.p2p.step_metadata import LoadSpec
from mooncake_vllm.transfer.engine import TransferAgent


def init_pull_thread() -> None:
    """A pull thread is latency-critical for its whole life, not only for its side-channel round
    trip: an acquire whose reply has arrived still waits behind vLLM's busy-waiting threads once
    the thread drops back to normal priority (docs/benchmarks.md, A/B runs). It sleeps between
    polls, so the priority (``thread_priority``) costs nothing while idle."""
    name_this_thread("mc-pull")
    make_latency_critical()


class PullFailed(RuntimeError):
    pass


@dataclass
class Totals:
    """One pull's figures, summed over the producer ranks it reads."""

    nbytes: int = 0
    entries: int = 0
    acquire_s: float = 0.0
    read_s: float = 0.0
    retries: int = 0
    stalls: int = 0
    layered: bool = False
    # A layered pull: when its prefill had written every layer (its time counts from there).
    all_written_at: float | None = None

    def add(self, read) -> None:
        """Adds one ``TransferAgent.read``."""
        self.nbytes += read.bytes
        self.entries += read.entries
        self.read_s += read.duration_s
        self.retries += read.retries
        self.stalls += read.stalls


class Source(NamedTuple):
    """What this rank does at one producer rank."""

    heads: list[int]  # read there (none: the lease is only acquired and released)
    readers: int  # consumer ranks that acquire that rank's lease
    tp_rank: int  # that rank's TP rank (its pipeline stage's workers have one each)


@dataclass(frozen=True)
class Pull:
    """One pull in progress: its load, handoff and job, and its figures so far."""

    load: LoadSpec
    handoff: Handoff
    job: LoadJob[Any]
    out: Totals
    # The grant's segments that hold ours (``Reader.stage_segments``); None: all, in order.
    held: dict[int, int] | None = None


def check_trusted(cfg: ConnectorConfig, host: str, what: str) -> None:
    """Raises PullFailed when ``host`` is not in ``trusted_producers`` (when that is set)."""
    trusted = cfg.settings.trusted_producers
    if trusted is not None and not host_allowed(host, trusted):
        raise PullFailed(
            f"{what} {host!r} is not in trusted_producers {trusted}; add it there to pull from it"
        )


class Reader:
    """This rank's layout and the reads into it; ``attach`` once the KV cache is registered."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        tp_rank: int,
        kv_replicated: bool = False,
        kv_heads: int = 1,
        block_size: int | None = None,
        kv_groups: tuple[KVGroup, ...] = (KVGroup(()),),
    ):
        self._cfg = cfg
        self._tp_rank = tp_rank
        self._groups = kv_groups
        # MLA: the latent is the same on every TP rank (see planning.producer_rank_for).
        self._kv_replicated = kv_replicated
        self._kv_heads = kv_heads
        self._heads = rank_heads(kv_heads, cfg.tp_size, tp_rank)
        self._block_size = block_size
        self._engine: TransferAgent | None = None
        self._segments: list[MemSegment] = []
        self._owners: list[str] = []  # each segment's layer
        self._group_segments: list[list[int]] = []  # per group: its layers' segment indices
        self._layers: list[torch.Tensor] = []  # re-blocking: the KV tensors in segment order
        self._staging: torch.Tensor | None = None  # ... and one staging buffer
        self._staging_lock = threading.Lock()
        # A re-blocking pull reads its next chunk here while it rearranges the last one.
        self._staging_reads = ThreadPoolExecutor(
            1, thread_name_prefix="mooncake-staging", initializer=init_pull_thread
        )

    def attach(
        self,
        engine: TransferAgent,
        segments: list[MemSegment],
        owners: list[str] | None = None,
        group_segments: list[list[int]] | None = None,
        layers: list[torch.Tensor] | None = None,
        staging: torch.Tensor | None = None,
    ) -> None:
        """What the reads write into: ``segments`` (each of ``owners``' layer, grouped by KV
        cache group in ``group_segments``), and ``layers`` and ``staging`` for re-blocking."""
        self._engine, self._segments = engine, list(segments)
        self._owners, self._group_segments = list(owners or []), list(group_segments or [])
        self._layers, self._staging = list(layers or []), staging

    @property
    def attached(self) -> bool:
        return self._engine is not None

    def all_segments(self) -> set[int]:
        """Every segment of ours, by index (what a grant of every layer covers)."""
        return set(range(len(self._owners)))

    def shutdown(self) -> None:
        self._staging_reads.shutdown(wait=True)

    def read_layers(
        self,
        pull: Pull,
        rank: int,
        heads: list[int],
        reply: Granted,
        await_layers: Callable[[int, float], object],
    ) -> None:
        """``read`` for a grant given while the prefill computes (``layerwise_handoff``): the
        layers written so far, then each batch the producer reports, until it says ``ALL_LAYERS``
        (every layer written in the request's last step, or the request has finished);
        ``await_layers(known, wait_s)`` asks the producer for more (``Await``). A refusal (the
        lease ended: the prefill was aborted before its layers were all written) fails the
        pull."""
        h, deadline = pull.handoff, pull.job.deadline_s
        if not heads:  # acquired only to be released: nothing to read, nothing to wait for
            return
        # Another block size re-blocks all layers at once, once they are all written.
        by_layer = self._block_size is None or h.block_size == self._block_size
        ready, done, every = reply.ready, 0, (1 << len(self._segments)) - 1
        while True:
            if pull.out.all_written_at is None and ready in (ALL_LAYERS, every):
                pull.out.all_written_at = time.monotonic()
            if by_layer:
                new = (every if ready == ALL_LAYERS else ready) & ~done
                if new:
                    layers = [i for i in range(len(self._segments)) if new >> i & 1]
                    self.read(pull, rank, heads, reply, layers)
                    done |= new
                    pull.out.layered |= ready != ALL_LAYERS
            if ready == ALL_LAYERS:
                break
            wait_s = deadline - time.monotonic()
            if wait_s <= 0:
                raise PullFailed("the prefill did not finish before the load's deadline")
            got = await_layers(ready, wait_s)
            if isinstance(got, Refused):
                raise PullFailed(got.reason)
            if not isinstance(got, Progress):
                raise PullFailed(f"unexpected reply {type(got).__name__}")
            ready = got.ready
        if not by_layer:
            self.read(pull, rank, heads, reply)

    def read(
        self,
        pull: Pull,
        rank: int,
        heads: list[int],
        reply: Granted,
        layers: list[int] | None = None,
    ) -> None:
        """Reads ``heads`` of the prompt from producer rank ``rank`` (granted ``reply``) into
        this rank's blocks, adding to ``pull.out``; raises on failure. ``layers``: only these
        (segment order; same block size only)."""
        load, h, job = pull.load, pull.handoff, pull.job
        assert self._engine is not None
        check_trusted(self._cfg, reply.te_segment.rpartition(":")[0], "transfer-engine segment")
        if reply.incarnation != h.producer_incarnation:
            raise PullFailed(
                f"granted by incarnation {reply.incarnation!r} of the producer, the handoff "
                f"is from {h.producer_incarnation!r}"
            )
        held = pull.held  # a pipeline stage's layers: those it holds
        if self._block_size is not None and h.block_size != self._block_size:
            if held is not None:
                raise PullFailed(
                    f"block size {h.block_size} at the producer, {self._block_size} here: a "
                    "pipeline-parallel engine's KV moves at one block size (set "
                    "--block-size alike on both sides)"
                )
            self._read_reblocked(pull, rank, heads, reply)
            return
        src, dst = reply.segments, self._segments
        if held == {}:
            return  # a stage of the producer with none of our layers
        if held is not None:  # by our segment index: a list with a hole where a stage lacks one
            if layers is not None:
                raise PullFailed("layer-by-layer reads from a pipeline stage are not supported")
            src = [src[held[i]] if i in held else None for i in range(len(dst))]
        # Each KV cache group: its producer blocks, its local blocks, where they start.
        fills = [(load.remote_block_ids, load.local_block_ids, load.first_token, None)]
        if load.groups or len(self._groups) > 1 or self._groups[0].sliding_window:
            if len(src) != len(dst):
                raise PullFailed(f"{len(src)} remote segments vs {len(dst)} local ones")
            if len(h.group_block_ids) != len(load.groups):
                raise PullFailed(
                    f"{len(h.group_block_ids) + 1} KV cache groups in the handoff, "
                    f"{len(load.groups) + 1} planned here"
                )
            remotes = [load.remote_block_ids, *h.group_block_ids]
            fills = [
                (remote, g.local_block_ids, g.first_token, i)
                for i, (remote, g) in enumerate(zip(remotes, [load, *load.groups], strict=True))
            ]
        end = load.end_token or h.prompt_len
        regions: list = []
        for remote, local, first, group in fills:
            g_src, g_dst = src, dst
            if group is not None:
                try:
                    local, first = trim_to_remote(
                        group, self._groups[group], remote, local, first, end, h.block_size
                    )
                except GroupError as e:
                    raise PullFailed(str(e)) from e
                if not local:
                    continue  # this group's blocks are all in the local prefix cache
                pick = self._group_segments[group]
                g_src, g_dst = [src[i] for i in pick], [dst[i] for i in pick]
            elif layers is not None:
                if len(src) != len(dst):
                    raise PullFailed(f"{len(src)} remote segments vs {len(dst)} local ones")
                g_src, g_dst = [src[i] for i in layers], [dst[i] for i in layers]
            if held is not None:  # only the segments this stage holds
                pairs = [(s, d) for s, d in zip(g_src, g_dst, strict=True) if s is not None]
                if not pairs:
                    continue
                g_src, g_dst = [s for s, _ in pairs], [d for _, d in pairs]
            regions += plan_pull(
                g_src,
                g_dst,
                heads=heads,
                src_heads=rank_heads(self._kv_heads, h.producer_tp_size, rank),
                dst_heads=self._heads,
                src_block_size=h.block_size,
                dst_block_size=self._block_size or h.block_size,
                remote_block_ids=remote,
                local_block_ids=local,
                first_token=first,
                end_token=end,
            )
        self._warm_up(reply, job)
        self._read_regions(pull, reply, regions, job.start_writing)

    def _warm_up(self, reply: Granted, job: LoadJob[Any]) -> None:
        """The first contact with a producer does the engine's handshake, which can block: into
        a scratch buffer, so an abandoned pull never writes into the blocks."""
        assert self._engine is not None
        self._engine.warm_up(
            reply.te_segment,
            reply.segments[0].base_addr,
            deadline=job.deadline_s,
            stall_s=self._cfg.settings.stall_timeout_s,
            incarnation=reply.incarnation,
        )

    def _read_regions(
        self, pull: Pull, reply: Granted, regions: list, should_start=lambda: True
    ) -> None:
        """One engine read of ``regions`` from the granted segment, added to ``pull.out``;
        ``should_start`` is asked before the first write (``TransferAgent.read``)."""
        assert self._engine is not None
        s = self._cfg.settings
        read = self._engine.read(
            reply.te_segment,
            regions,
            deadline=pull.job.deadline_s,
            stall_s=s.stall_timeout_s,
            max_in_flight=s.max_batch_entries,
            should_start=should_start,
        )
        pull.out.add(read)

    def _read_reblocked(self, pull: Pull, rank: int, heads: list[int], reply: Granted) -> None:
        """``_read`` from a producer of another block size: the needed heads' slabs of the remote
        blocks, a chunk at a time into one half of the staging buffer while the chunk before is
        rearranged into this rank's blocks from the other (``core.reblock``)."""
        load, h, job = pull.load, pull.handoff, pull.job
        assert self._engine is not None and self._block_size is not None
        assert self._staging_reads is not None
        if self._staging is None:
            raise PullFailed(
                f"block size {h.block_size} at the producer, {self._block_size} here, and no "
                "staging buffer to re-block (reblock_buffer_bytes)"
            )

        def before_writing() -> None:
            if not job.start_writing():  # abandoned at its deadline: touch no block
                raise PullFailed("abandoned at its deadline while staging")

        self._warm_up(reply, job)
        with self._staging_lock:  # one re-blocking pull at a time: they share the buffer
            try:
                pull_through_staging(
                    staging=self._staging,
                    src=reply.segments,
                    layers=self._layers,
                    heads=heads,
                    src_heads=rank_heads(self._kv_heads, h.producer_tp_size, rank),
                    first_head=heads[0] - self._heads.start,
                    src_block_size=h.block_size,
                    dst_block_size=self._block_size,
                    remote_block_ids=load.remote_block_ids,
                    local_block_ids=load.local_block_ids,
                    first_token=load.first_token,
                    end_token=load.end_token or h.prompt_len,
                    read=lambda regions: self._read_regions(pull, reply, regions),
                    before_writing=before_writing,
                    submit=self._staging_reads.submit,
                )
            except PlanError as e:
                raise PullFailed(str(e)) from e

    def sources(self, h: Handoff) -> dict[int, Source]:
        """The producer ranks whose lease this rank acquires, each with the heads it reads
        there (none: acquired only to be released, so the lease ends) and the lease's readers."""
        producer_tp, tp = h.producer_tp_size, self._cfg.tp_size
        stages = range(h.producer_pp_size)  # each stage's ranks hold its layers
        # Every stage of ours acquires every producer rank it reads heads at (a stage whose
        # layers are not there reads nothing, and releases).
        ours = self._cfg.pp_size
        if self._kv_replicated:  # one lease per stage: acquire it where the latent is read
            p = producer_rank_for(self._tp_rank, tp, producer_tp, True)
            return {s * producer_tp + p: Source([0], tp * ours, p) for s in stages}
        heads = head_sources(self._kv_heads, producer_tp, tp, self._tp_rank)
        return {
            s * producer_tp + p: Source(
                [x for x, q in heads.items() if q == p], len(ranks) * ours, p
            )
            for s in stages
            for p, ranks in lease_readers(self._kv_heads, producer_tp, tp).items()
            if self._tp_rank in ranks
        }

    def check_covered(self, covered: set[int], h: Handoff) -> None:
        """Raises PullFailed naming the layers of ours that no producer stage holds (a draft
        model's, when only this side speculates)."""
        missing = sorted(set(self._owners) - {self._owners[i] for i in covered})
        if missing:
            names = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise PullFailed(
                f"the producer holds no KV of layer(s) {names} (its {h.producer_pp_size} "
                "pipeline stage(s) hold the others): a draft model's layer? Serve the prefill "
                "with the decode's --speculative-config, so that it computes the draft's KV too"
            )

    def stage_segments(self, reply: Granted) -> dict[int, int] | None:
        """This rank's segments that a producer rank's grant holds, by index, to the index of
        the same layer's segment there; None when it holds every layer of ours in our order (a
        producer of one pipeline stage, or one from before pipeline parallel)."""
        if not reply.layers or reply.layers == self._owners:
            return None
        if len(reply.layers) != len(reply.segments):
            raise PullFailed(f"{len(reply.layers)} layer names for {len(reply.segments)} segments")
        theirs: dict[str, list[int]] = {}
        for i, name in enumerate(reply.layers):
            theirs.setdefault(name, []).append(i)
        ours: dict[str, list[int]] = {}
        for i, name in enumerate(self._owners):
            ours.setdefault(name, []).append(i)
        out: dict[int, int] = {}
        for name, mine in ours.items():
            there = theirs.get(name)
            if there is None:
                continue  # another stage's layer
            if len(there) != len(mine):
                raise PullFailed(
                    f"layer {name}: {len(there)} segments at the producer, {len(mine)} here"
                )
            out.update(zip(mine, there, strict=True))
        return out
