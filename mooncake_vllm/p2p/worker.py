"""The worker half: runs in every vLLM worker process and moves the bytes.

Producer: registers the KV cache with the transfer engine and hands its layout to the scheduler
half (vLLM's handshake metadata), whose side channel serves the leases (``leases.client``); reports
the requests whose leases ended as finished-sending, which frees the blocks.

Consumer: each load is one pull job on a small thread pool, off the forward path. For each
producer rank holding heads this rank needs (``planning.head_sources``; any TP sizes): ``Acquire``
(side channel) → plan regions (``planning.plan_pull``; any block sizes) → transfer-engine read →
``Release``. The job never
raises; its outcome is collected by ``get_transfer_results`` on the step thread, so no failure is
lost. A failed pull is reported in ``failed_recving`` and vLLM's ``kv_load_failure_policy``
decides. When a pull ends the worker wakes the scheduler half (``local_channels``), which lets
vLLM rest while nothing else is to be done.

Deadline (``load_timeout_s``) and late writes: the transfer engine cannot cancel a read. A pull
not done a quarter second past its deadline is reported failed at once (vLLM's policy then fails or
recomputes the request); its destination blocks stay pinned by the scheduler half until this
worker reports the load *settled* (``MooncakeWorkerMeta``), which happens only when its thread has
returned (``core.loads.LoadJobs``) — and ``TransferAgent.read`` returns only once every entry it
submitted has ended (a stalled entry is ended by the engine after ``stall_timeout_s`` without
progress; no attempt starts unless it can end by the deadline). A pull still in the acquire or the
engine's first handshake (which can block in C++) at the deadline submits nothing afterwards
(``LoadJob.start_writing`` decides under a lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from mooncake_vllm.core import tracing
from mooncake_vllm.core.auth import AuthError, host_allowed, open_record, seal_record, short_id
from mooncake_vllm.core.kv_groups import GroupError, KVGroup, group_segments, trim_to_remote
from mooncake_vllm.core.loads import LoadJob, LoadJobs, LoadOutcome, MooncakeWorkerMeta
from mooncake_vllm.core.os_threads import make_latency_critical, name_this_thread
from mooncake_vllm.core.planning import (
    REBLOCKABLE,
    PlanError,
    head_sources,
    kv_cache_regions,
    lease_readers,
    plan_pull,
    producer_rank_for,
    rank_heads,
)
from mooncake_vllm.core.reblock import pull_through_staging
from mooncake_vllm.core.registry import (
    EngineRecord,
    ServingRecord,
    decode_record,
    encode_record,
    encode_serving,
    registry_key,
    serving_key,
)
from mooncake_vllm.core.serving_url import find_serving_url
from mooncake_vllm.core.worker_stats import WorkerStats
from mooncake_vllm.metadata import P2P_HANDSHAKE
from mooncake_vllm.p2p.config import ConnectorConfig
from mooncake_vllm.p2p.leases.process import LayerDone, encode
from mooncake_vllm.p2p.local_channels import WakeSender, claim, layers_endpoint, wake_endpoint
from mooncake_vllm.p2p.protocol import (
    ALL_LAYERS,
    OWNER_BYTES,
    Acquire,
    Await,
    Granted,
    Handoff,
    HandoffError,
    MemSegment,
    PendingHandoff,
    Progress,
    Refused,
    Release,
    validate_handoff,
)
from mooncake_vllm.p2p.side_channel import CallCancelled, SideChannelClient, SideChannelError
from mooncake_vllm.p2p.stats import MooncakeStats
from mooncake_vllm.p2p.step_metadata import LoadSpec, MooncakeConnectorMetadata
from mooncake_vllm.p2p.upstream import BootstrapError, BootstrapResolver
from mooncake_vllm.transfer.engine import TransferAgent
from mooncake_vllm.transfer.store_bridge import KeyScope, MetadataBridge

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 2.0
_PENDING_MARGIN_S = 0.5  # a pending acquire's wait at the producer ends this much earlier
_PULL_THREADS = 8  # pulls mostly sleep (side channel, status polls); a stuck one must not queue


def _init_pull_thread() -> None:
    """A pull thread is latency-critical for its whole life, not only for its side-channel round
    trip: an acquire whose reply has arrived still waits behind vLLM's busy-waiting threads once
    the thread drops back to normal priority (docs/benchmarks.md, A/B runs). It sleeps between
    polls, so the priority (``thread_priority``) costs nothing while idle."""
    name_this_thread("mc-pull")
    make_latency_critical()


class PullFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class PullOutcome(LoadOutcome):
    entries: int = 0
    acquire_s: float = 0.0  # side-channel round trip, producer wait included
    read_s: float = 0.0  # transfer-engine read
    refused: bool = False
    cancelled: bool = False  # a pending pull withdrawn: its request ended first
    layered: bool = False  # began reading before its prefill had finished (layerwise_handoff)
    retries: int = 0
    stalls: int = 0


@dataclass
class _Totals:
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


class _Source(NamedTuple):
    """What this rank does at one producer rank."""

    heads: list[int]  # read there (none: the lease is only acquired and released)
    readers: int  # consumer ranks that acquire that rank's lease
    tp_rank: int  # that rank's TP rank (its pipeline stage's workers have one each)


@dataclass(frozen=True)
class _Pull:
    """One pull in progress: its load, handoff and job, and its figures so far."""

    load: LoadSpec
    handoff: Handoff
    job: LoadJob[PullOutcome]
    out: _Totals
    # The grant's segments that hold ours (``WorkerHalf._stage_segments``); None: all, in order.
    held: dict[int, int] | None = None


def _memory_location(t: torch.Tensor) -> str:
    # GPU hosts: tell the engine which device owns the memory. CPU: let it detect.
    return f"cuda:{t.device.index}" if t.device.type == "cuda" else "*"


class WorkerHalf:
    def __init__(
        self,
        cfg: ConnectorConfig,
        tp_rank: int,
        compat_hash: str,
        num_blocks: int,
        kv_replicated: bool = False,
        kv_heads: int = 1,
        block_size: int | None = None,
        kv_format: str = "",
        kv_groups: tuple[KVGroup, ...] = (KVGroup(()),),
        pp_rank: int = 0,
    ):
        """``pp_rank``: this worker's pipeline stage (its ports are those of worker rank
        ``cfg.rank(tp_rank, pp_rank)``); ``kv_heads``: the model's KV heads, all ranks (1 for
        an MLA latent); ``block_size``:
        this engine's (None: whole-block copies from a producer of the same layout only);
        ``kv_format``: how its blocks keep their tokens (``vllm_glue.kv_format``);
        ``kv_groups``: the KV cache groups (``core.kv_groups``), each read with its own blocks
        into the segments of its own layers."""
        self._cfg = cfg
        # vLLM's --otlp-traces-endpoint: a span per pull and per release; None: off.
        self._tracer = tracing.tracer(cfg.otlp_traces_endpoint, tracing.CONNECTOR_SERVICE, "grpc")
        self._groups = kv_groups
        self._group_segments: list[list[int]] = []  # per group: its layers' segment indices
        self._tp_rank = tp_rank
        self._rank = cfg.rank(tp_rank, pp_rank)
        # A grant while the prefill computes names written layers in the producer's segment
        # order; a consumer of several pipeline stages holds other segments: it is granted once
        # every layer is written.
        self._layers_ok = cfg.pp_size == 1
        self._owners: list[str] = []  # each segment's layer
        # MLA: the latent is the same on every TP rank (see planning.producer_rank_for).
        self._kv_replicated = kv_replicated
        self._kv_heads = kv_heads
        self._heads = rank_heads(kv_heads, cfg.tp_size, tp_rank)
        self._block_size = block_size
        self._kv_format = kv_format
        # Re-blocking (core.reblock): the KV tensors in segment order, and one staging buffer.
        self._layers: list[torch.Tensor] = []
        self._staging: torch.Tensor | None = None
        self._staging_lock = threading.Lock()
        self._num_blocks = num_blocks
        self._engine: TransferAgent | None = None
        self._segments: list[MemSegment] = []
        self._bytes_per_block = 0
        self._claim: zmq.Socket | None = None
        self._finished_sending: set[str] = set()  # from the scheduler's metadata, this step
        # Producer, ``layerwise_handoff``: the layer of each KV tensor (segment order), and the
        # socket to the lease server.
        self._layer_index: dict[str, int] = {}
        self._marks_out: zmq.Socket | None = None
        # Pending pulls (waiting for their prefill), set when vLLM finished their request.
        self._cancels: dict[str, threading.Event] = {}
        self._client: SideChannelClient | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pulls: LoadJobs[PullOutcome] | None = None
        self._wake: WakeSender | None = None
        self._stats = WorkerStats(MooncakeStats)
        self._bridge: MetadataBridge | None = None
        self._compat_hash = compat_hash
        self._keys = cfg.settings.auth_keys()  # read once: a rotated secret needs a restart
        self._releases: ThreadPoolExecutor | None = None
        self._staging_reads: ThreadPoolExecutor | None = None
        # Pending handoffs named by their producer's bootstrap (upstream's convention).
        self._bootstraps = BootstrapResolver()
        if cfg.is_consumer:
            self._client = SideChannelClient(self._keys)
            self._pool = ThreadPoolExecutor(
                _PULL_THREADS, thread_name_prefix="mooncake-pull", initializer=_init_pull_thread
            )
            self._pulls = LoadJobs(self._pool, noun="pull", wake=self._wake_scheduler)
            # Releases go out beside the pulls: a producer that does not answer must not delay
            # the outcome vLLM waits for (its lease TTL frees the blocks anyway).
            self._releases = ThreadPoolExecutor(1, thread_name_prefix="mooncake-release")
            # A re-blocking pull reads its next chunk here while it rearranges the last one.
            self._staging_reads = ThreadPoolExecutor(
                1, thread_name_prefix="mooncake-staging", initializer=_init_pull_thread
            )

    # ---- setup ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # vLLM's CPU attention keeps a head's K column-major inside a block: heads split into
        # byte ranges, tokens do not (other block sizes would need a staging copy).
        owners: list[str] = []
        segments, tensors = kv_cache_regions(
            kv_caches,
            self._num_blocks,
            self._block_size,
            len(self._heads),
            tokens_addressable=False,
            owners=owners,
        )
        self._group_segments = group_segments(self._groups, owners)
        self._owners = owners
        storages = {a: (n, _memory_location(t)) for a, (n, t) in tensors.items()}
        self._segments = segments
        self._bytes_per_block = sum(s.block_len for s in segments)
        cfg, s = self._cfg, self._cfg.settings
        side_channel = ""
        if cfg.is_producer:
            # Claimed first, so a second engine configured with the same address fails here,
            # before its transfer engine can publish metadata over ours. The side channel itself
            # is served by the scheduler half (leases.client).
            side_channel = f"{cfg.host}:{cfg.side_channel_port(self._rank)}"
            try:
                self._claim = claim(cfg.host, cfg.side_channel_port(self._rank))
            except zmq.ZMQError as e:
                raise SideChannelError(
                    f"another engine on this host uses {side_channel} ({e}); set "
                    "prefill_url/decode_url ports apart"
                ) from e
        self._wake = WakeSender(wake_endpoint(cfg.host, cfg.base_port))
        metadata_arg = P2P_HANDSHAKE
        if cfg.metadata.kind != "p2p":
            self._bridge = MetadataBridge(
                cfg.metadata,
                ttl_s=s.metadata_ttl_s,
                auth=s.metadata_auth,
                scope=KeyScope.for_engine(
                    cfg.engine_id, self._rank, cfg.engine_hostname(self._rank)
                ),
            )
            metadata_arg = self._bridge.url
        try:
            self._engine = TransferAgent(
                cfg.engine_hostname(self._rank),
                metadata_arg,
                s.protocol,
                s.device_name,
                env=cfg.engine_env(),
            )
        except BaseException:
            self.shutdown()
            raise
        for addr, (nbytes, location) in sorted(storages.items()):
            self._engine.register(addr, nbytes, location)
        self._layers = [kv_caches[name] for name in sorted(kv_caches)]
        if cfg.is_producer and s.layerwise_handoff:
            self._open_marks(kv_caches, segments)
        if (
            cfg.is_consumer
            and self._kv_format == REBLOCKABLE
            and s.reblock_buffer_bytes
            and len(self._layers) == len(segments)
        ):
            self._staging = torch.empty(s.reblock_buffer_bytes, dtype=torch.uint8)
            self._engine.register(self._staging.data_ptr(), s.reblock_buffer_bytes, "*")
        if self._bridge is not None:
            record = EngineRecord(
                engine_id=cfg.engine_id,
                role=cfg.role,
                tp_rank=self._rank,
                tp_size=cfg.ranks,
                side_channel=side_channel,
                te_segment=self._engine.segment_name,
                compat_hash=self._compat_hash,
            )
            self._bridge.publish(
                registry_key(cfg.engine_id, self._rank),
                seal_record(self._keys, encode_record(record)),
            )
            if self._rank == 0:
                self._publish_serving_url()
        logger.info(
            "MooncakeConnector worker rank %d (%s): %d layers, %d segments, %d B/block, "
            "%d KV cache group(s) (%s), engine %s, side channel %s, metadata %s",
            self._rank,
            cfg.role,
            len(kv_caches),
            len(segments),
            self._bytes_per_block,
            len(self._groups),
            ", ".join(g.describe() for g in self._groups),
            self._engine.segment_name,
            side_channel or "-",
            cfg.metadata.describe(),
        )

    def _open_marks(self, kv_caches: dict[str, torch.Tensor], segments: list[MemSegment]) -> None:
        """``layerwise_handoff``: layer ``i`` of a prompt is segment ``i`` of its blocks."""
        on_cpu = all(t.device.type == "cpu" for t in kv_caches.values())
        if len(segments) != len(kv_caches) or not on_cpu:
            raise RuntimeError(
                "layerwise_handoff needs one KV tensor per layer in CPU memory (vLLM's CPU "
                f"attention); this engine has {len(kv_caches)} layers in {len(segments)} "
                "segments: set layerwise_handoff to false"
            )
        self._layer_index = {name: i for i, name in enumerate(sorted(kv_caches))}
        self._marks_out = zmq.Context.instance().socket(zmq.PUSH)
        self._marks_out.setsockopt(zmq.LINGER, 0)
        self._marks_out.connect(layers_endpoint(self._cfg.host, self._cfg.base_port))

    def save_layer(self, layer_name: str, meta: MooncakeConnectorMetadata) -> None:
        """vLLM has written ``layer_name``'s KV of this step (CPU: before this call returns):
        tell the lease server, for the prompts this step completes (``meta``, the step's
        metadata, bound before the forward; vLLM calls ``start_load_kv`` only after it)."""
        if not meta.layer_marks or self._marks_out is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        done = LayerDone(meta.layers_token, self._rank, layer, meta.layer_marks)
        # ZMQError: the lease server is gone or behind; the finish still hands over.
        with contextlib.suppress(zmq.ZMQError):
            self._marks_out.send(encode(done), zmq.NOBLOCK)

    def _publish_serving_url(self) -> None:
        """Publish where this engine serves the OpenAI API, for ``proxy_server.py --discover``
        (the bridge keeps it alive with the other keys and deletes it when the engine stops)."""
        cfg = self._cfg
        url = cfg.settings.advertise_url or find_serving_url(cfg.host)
        if url is None:
            logger.info(
                "MooncakeConnector: no vLLM API server found above this process and no "
                "advertise_url set: engine %s is not published for proxy discovery",
                cfg.engine_id,
            )
            return
        assert self._bridge is not None
        record = ServingRecord(
            engine_id=cfg.engine_id, role=cfg.role, url=url, compat_hash=self._compat_hash
        )
        self._bridge.publish(
            serving_key(cfg.engine_id),
            seal_record(self._keys, encode_serving(record)),
        )
        logger.info("MooncakeConnector: published %s %s for proxy discovery", cfg.role, url)

    @property
    def te_segment(self) -> str | None:
        return self._engine.segment_name if self._engine else None

    @property
    def segments(self) -> list[MemSegment]:
        return list(self._segments)

    @property
    def layers(self) -> list[str]:
        """Each segment's layer (a pipeline stage holds its own)."""
        return list(self._owners)

    # ---- every step ----------------------------------------------------------------------

    def _wake_scheduler(self) -> None:
        if self._wake is not None:
            self._wake.wake()

    def start_load_kv(self, meta: MooncakeConnectorMetadata) -> None:
        self._finished_sending |= meta.finished_sending
        for load in meta.loads:
            assert self._pulls is not None, "loads are only planned on a consumer"
            if isinstance(load.handoff, PendingHandoff):
                self._cancels[load.req_id] = threading.Event()
            # vLLM waits for no outcome of a load without blocks: its lease is only released.
            self._pulls.submit(
                load.req_id,
                partial(self._pull, load),
                self._cfg.settings.load_timeout_s,
                awaited=load.fills_blocks,
            )
        for req_id in meta.cancelled:  # after the loads: one may end in the step it began
            if (event := self._cancels.get(req_id)) is not None:
                event.set()

    def _overdue(self, job: LoadJob[PullOutcome]) -> PullOutcome:
        stage = "acquire or first handshake" if job.abandon() else "read"
        reason = (
            f"not done {self._cfg.settings.load_timeout_s:g}s (load_timeout_s) after it "
            f"started, still in the {stage}; its blocks stay pinned until it has ended"
        )
        return PullOutcome(job.req_id, ok=False, reason=reason)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        results.finished_sending, self._finished_sending = self._finished_sending, set()
        outcomes = self._pulls.collect(self._overdue) if self._pulls is not None else []
        for outcome in outcomes:  # _pull never raises
            req_id = outcome.req_id
            results.finished_recving.add(req_id)
            with self._stats.update() as stats:
                if outcome.ok:
                    stats.record_pull(
                        outcome.nbytes,
                        outcome.blocks,
                        outcome.entries,
                        outcome.duration_s,
                        acquire_s=outcome.acquire_s,
                        read_s=outcome.read_s,
                    )
                    stats.count("retries", outcome.retries)
                    stats.count("stalls", outcome.stalls)
                    stats.count("layered", int(outcome.layered))
                elif outcome.cancelled:  # vLLM finished the request: no outcome is awaited
                    logger.info("request %s: KV pull withdrawn: %s", req_id, outcome.reason)
                    stats.count("cancelled")
                else:
                    logger.warning("request %s: KV pull failed: %s", req_id, outcome.reason)
                    results.failed_recving.add(req_id)
                    stats.count("pull_failures")
                    if outcome.refused:
                        stats.count("refused")
        return results

    def build_worker_meta(self) -> MooncakeWorkerMeta | None:
        return self._pulls.worker_meta() if self._pulls is not None else None

    def get_stats(self) -> MooncakeStats | None:
        if self._client is not None:
            with self._stats.update() as stats:
                stats.count("rejected_frames", self._client.take_rejected())
        return self._stats.take()

    # ---- the pull ------------------------------------------------------------------------

    def _pull(self, load: LoadSpec, job: LoadJob[PullOutcome]) -> PullOutcome:
        start_ns = tracing.now_ns()
        try:
            outcome = self._pull_once(load, job)
        finally:
            self._cancels.pop(load.req_id, None)
        if load.trace and self._tracer is not None:
            self._pull_span(load, job, outcome, start_ns)
        return outcome

    def _pull_span(
        self, load: LoadSpec, job: LoadJob[PullOutcome], out: PullOutcome, start_ns: int
    ) -> None:
        """``mooncake.pull`` under the request's trace, from what the pull measured: its
        bootstrap resolve and acquire from its start, its read ending at its end (the
        durations are measured; where several producer ranks were read, they are summed)."""
        end_ns = tracing.now_ns()
        h = load.handoff
        span = tracing.Span("mooncake.pull", start_ns, end_ns, {
            "mooncake.request_id": load.req_id,
            "mooncake.transfer_id": h.transfer_id if h is not None else None,
            "mooncake.rank": self._rank, "mooncake.ok": out.ok, "mooncake.bytes": out.nbytes,
            "mooncake.blocks": out.blocks, "mooncake.entries": out.entries,
            "mooncake.retries": out.retries, "mooncake.layered": out.layered,
            "mooncake.refused": out.refused, "mooncake.cancelled": out.cancelled,
            "mooncake.failure_reason": out.reason or None,
        })  # fmt: skip
        if not out.ok:
            span.error = out.reason or "pull failed"
        at = start_ns
        if job.resolve_s:
            span.child("mooncake.bootstrap_resolve", at, at + int(job.resolve_s * 1e9))
            at += int(job.resolve_s * 1e9)
        if out.acquire_s:
            span.child("mooncake.acquire", at, at + int(out.acquire_s * 1e9))
        if out.read_s:
            span.child("mooncake.read", end_ns - int(out.read_s * 1e9), end_ns,
                       **{"mooncake.bytes": out.nbytes, "mooncake.blocks": out.blocks})  # fmt: skip
        tracing.record(self._tracer, span, load.trace)

    def _pull_once(self, load: LoadSpec, job: LoadJob[PullOutcome]) -> PullOutcome:
        start, deadline = time.monotonic(), job.deadline_s
        if isinstance(load.handoff, PendingHandoff) and load.handoff.unresolved:
            try:
                load = self._resolved(load, deadline - start)
            except PullFailed as e:  # nothing acquired: nothing to release
                return PullOutcome(load.req_id, ok=not load.fills_blocks, reason=str(e))
            finally:
                job.resolve_s = time.monotonic() - start
        h = load.handoff
        if not load.fills_blocks:  # vLLM does not wait on this one: just free the lease
            if h is not None:
                digest = load.checks.get("prompt_digest", "")
                self._give_back(h, load.error is None, deadline - start, digest)
            return PullOutcome(load.req_id, ok=True)
        # Acquired leases, by producer side channel, with the owner token that releases each.
        acquired: dict[str, bytes] = {}
        succeeded = False
        try:
            if load.error is not None:
                if h is not None:  # rejected (e.g. another model's KV): free its lease now
                    self._releases.submit(self._give_back, h, False)
                raise PullFailed(load.error)
            assert h is not None and self._engine is not None
            out = _Totals()
            covered: set[int] = set()  # our segments the grants read from hold
            sources = self._sources(h)
            for rank, (heads, readers, tp_rank) in sources.items():
                address = self._producer_address(h, rank)
                # Only the holder of this token can release the lease this acquire pins.
                owner = secrets.token_bytes(OWNER_BYTES)
                asked_at = time.monotonic()
                pending = isinstance(h, PendingHandoff)
                try:
                    reply = self._acquire(
                        address,
                        h,
                        owner,
                        readers,
                        deadline - asked_at,
                        self._cancels.get(load.req_id),
                        load.checks.get("prompt_digest", ""),
                    )
                except SideChannelError:
                    if pending:  # the wait still stands at the producer: the release withdraws it
                        acquired[address] = owner
                    raise
                if pending:  # it waited for the prefill: not the pull's time
                    start = time.monotonic()
                else:
                    out.acquire_s += time.monotonic() - asked_at
                if isinstance(reply, Refused):
                    return PullOutcome(load.req_id, ok=False, reason=reply.reason, refused=True)
                acquired[address] = owner
                if isinstance(h, PendingHandoff):
                    h = self._granted_handoff(h, reply, load)
                    load = dataclasses.replace(load, handoff=h, remote_block_ids=h.remote_block_ids)
                held = self._stage_segments(reply) if heads else None
                pull = _Pull(load, h, job, out, held)
                if heads:
                    covered |= set(range(len(self._owners))) if held is None else set(held)
                if rank == max(sources):  # every stage's layers known: before the last read
                    self._check_covered(covered, h)
                if reply.ready != ALL_LAYERS:  # the prefill computes: take layers as they come
                    self._read_layers(pull, tp_rank, heads, reply, address, owner)
                elif heads:
                    self._read(pull, tp_rank, heads, reply)
            succeeded = True
            logger.debug(
                "request %s: pulled %d blocks (%d B, %d entries) from %d producer rank(s): "
                "acquire %.1f ms, read %.1f ms",
                load.req_id,
                load.num_blocks,
                out.nbytes,
                out.entries,
                len(acquired),
                1000 * out.acquire_s,
                1000 * out.read_s,
            )
            if out.all_written_at is not None:  # read while the prefill computed: not the pull's
                start = max(start, out.all_written_at)
            figures = dataclasses.asdict(out)
            del figures["all_written_at"]
            return PullOutcome(
                load.req_id,
                ok=True,
                blocks=load.num_blocks,
                duration_s=time.monotonic() - start,
                **figures,
            )
        except CallCancelled as e:
            return PullOutcome(load.req_id, ok=False, reason=str(e), cancelled=True)
        except Exception as e:
            return PullOutcome(load.req_id, ok=False, reason=f"{type(e).__name__}: {e}")
        finally:
            for address, owner in acquired.items():
                self._releases.submit(
                    self._release, address, h.transfer_id, owner, succeeded, load.trace
                )

    def _read_layers(
        self,
        pull: _Pull,
        rank: int,
        heads: list[int],
        reply: Granted,
        address: str,
        owner: bytes,
    ) -> None:
        """``_read`` for a grant given while the prefill computes (``layerwise_handoff``): the
        layers written so far, then each batch the producer reports (``Await``), until it says
        ``ALL_LAYERS`` (every layer written in the request's last step, or the request has
        finished); a refusal (the lease ended: the prefill was aborted before its layers were
        all written) fails the pull."""
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
                    self._read(pull, rank, heads, reply, layers)
                    done |= new
                    pull.out.layered |= ready != ALL_LAYERS
            if ready == ALL_LAYERS:
                break
            wait_s = deadline - time.monotonic()
            if wait_s <= 0:
                raise PullFailed("the prefill did not finish before the load's deadline")
            wait_ms = int(max(0.1, wait_s - _PENDING_MARGIN_S) * 1000)
            got = self._client.call(
                address,
                Await(h.transfer_id, owner, ready, wait_ms),
                timeout_s=max(0.1, wait_s),
                cancelled=self._cancels.get(pull.load.req_id),
            )
            if isinstance(got, Refused):
                raise PullFailed(got.reason)
            if not isinstance(got, Progress):
                raise PullFailed(f"unexpected reply {type(got).__name__}")
            ready = got.ready
        if not by_layer:
            self._read(pull, rank, heads, reply)

    def _read(
        self,
        pull: _Pull,
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
        self._check_trusted(reply.te_segment.rpartition(":")[0], "transfer-engine segment")
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

    def _warm_up(self, reply: Granted, job: LoadJob[PullOutcome]) -> None:
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
        self, pull: _Pull, reply: Granted, regions: list, should_start=lambda: True
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

    def _read_reblocked(self, pull: _Pull, rank: int, heads: list[int], reply: Granted) -> None:
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

    def _resolved(self, load: LoadSpec, timeout_s: float) -> LoadSpec:
        """``load`` with its pending handoff's side channels, asked of the producer's bootstrap
        (``upstream.BootstrapResolver``: cached per engine id); raises PullFailed naming the
        bootstrap and why (it did not answer, or does not know the engine)."""
        h = load.handoff
        assert isinstance(h, PendingHandoff)
        try:
            h = self._bootstraps.resolve(h, timeout_s)
        except BootstrapError as e:
            raise PullFailed(str(e) if load.error is None else f"{load.error}; {e}") from e
        self._check_trusted(h.side_channel_host, "the side channel the bootstrap names,")
        return dataclasses.replace(load, handoff=h)

    def _sources(self, h: Handoff) -> dict[int, _Source]:
        """The producer ranks whose lease this rank acquires, each with the heads it reads
        there (none: acquired only to be released, so the lease ends) and the lease's readers."""
        producer_tp, tp = h.producer_tp_size, self._cfg.tp_size
        stages = range(h.producer_pp_size)  # each stage's ranks hold its layers
        # Every stage of ours acquires every producer rank it reads heads at (a stage whose
        # layers are not there reads nothing, and releases).
        ours = self._cfg.pp_size
        if self._kv_replicated:  # one lease per stage: acquire it where the latent is read
            p = producer_rank_for(self._tp_rank, tp, producer_tp, True)
            return {s * producer_tp + p: _Source([0], tp * ours, p) for s in stages}
        heads = head_sources(self._kv_heads, producer_tp, tp, self._tp_rank)
        return {
            s * producer_tp + p: _Source(
                [x for x, q in heads.items() if q == p], len(ranks) * ours, p
            )
            for s in stages
            for p, ranks in lease_readers(self._kv_heads, producer_tp, tp).items()
            if self._tp_rank in ranks
        }

    def _check_covered(self, covered: set[int], h: Handoff) -> None:
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

    def _stage_segments(self, reply: Granted) -> dict[int, int] | None:
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

    def _producer_address(self, h: Handoff, rank: int) -> str:
        """The side channel of producer rank ``rank``: named in the handoff, or looked up by
        the producer's engine id in the engine registry."""
        if h.side_channel_ports:
            return f"{h.side_channel_host}:{h.side_channel_ports[rank]}"
        if self._bridge is None:
            raise PullFailed(
                f"the handoff names no side channel for producer {h.producer_engine_id!r} and "
                "no metadata store is configured to look it up (metadata_server is P2PHANDSHAKE)"
            )
        data = self._bridge.lookup(registry_key(h.producer_engine_id, rank))
        if data is None:
            raise PullFailed(f"producer engine {h.producer_engine_id!r} is not in the registry")
        try:
            record = decode_record(open_record(self._keys, data))
        except AuthError as e:
            raise PullFailed(f"registry record of {h.producer_engine_id!r}: {e}") from e
        if not record.side_channel:
            raise PullFailed(f"engine {h.producer_engine_id!r} is a {record.role}, not a producer")
        if record.compat_hash != h.compat_hash:
            raise PullFailed(f"registry compat hash of {h.producer_engine_id!r} differs")
        self._check_trusted(record.side_channel.rpartition(":")[0], "registry side channel")
        return record.side_channel

    def _check_trusted(self, host: str, what: str) -> None:
        trusted = self._cfg.settings.trusted_producers
        if trusted is not None and not host_allowed(host, trusted):
            raise PullFailed(
                f"{what} {host!r} is not in trusted_producers {trusted}; add it there to pull "
                "from it"
            )

    def _acquire(
        self,
        address: str,
        h: Handoff | PendingHandoff,
        owner: bytes,
        readers: int,
        timeout_s: float,
        cancelled: threading.Event | None = None,
        prompt_digest: str = "",
    ) -> Granted | Refused:
        if isinstance(h, PendingHandoff):
            # No blocks or incarnation yet: the producer answers once the prefill's lease exists
            # (with ``layerwise_handoff``, while it still computes), and refuses a little before
            # this side gives up, so the reason arrives.
            wait_ms = int(max(0.1, timeout_s - _PENDING_MARGIN_S) * 1000)
            frame = Acquire(
                h.transfer_id,
                [],
                owner,
                readers,
                "",
                wait_ms=wait_ms,
                layers_ok=self._layers_ok,
                prompt_digest=prompt_digest,
            )
        else:
            # The acquire names all the hold's blocks, whatever this consumer reads of them. Its
            # grant may come while the prefill computes: a handoff granted by the first of
            # several producer ranks (``layerwise_handoff``).
            frame = Acquire(
                h.transfer_id,
                h.remote_block_ids,
                owner,
                readers,
                h.producer_incarnation,
                layers_ok=self._layers_ok,
            )
        reply = self._client.call(
            address, frame, timeout_s=max(0.1, timeout_s), cancelled=cancelled
        )
        if not isinstance(reply, Granted | Refused):
            raise PullFailed(f"unexpected reply {type(reply).__name__}")
        return reply

    def _granted_handoff(self, pending: PendingHandoff, reply: Granted, load: LoadSpec) -> Handoff:
        """The handoff a pending acquire was granted with, checked as the scheduler checks a
        handoff that comes with the request (``protocol.validate_handoff``)."""
        h = reply.handoff
        if h is None or h.transfer_id != pending.transfer_id:
            raise PullFailed("the producer granted a pending acquire without its handoff")
        if (h.producer_engine_id, h.producer_tp_size, h.producer_pp_size) != (
            pending.producer_engine_id,
            pending.producer_tp_size,
            pending.producer_pp_size,
        ):
            raise PullFailed(
                f"the pending handoff named producer {pending.producer_engine_id!r} (TP "
                f"{pending.producer_tp_size}, PP {pending.producer_pp_size}); "
                f"{h.producer_engine_id!r} (TP {h.producer_tp_size}, PP {h.producer_pp_size}) "
                "holds the transfer"
            )
        try:
            validate_handoff(h, **load.checks)
        except HandoffError as e:
            raise PullFailed(f"handoff rejected: {e}") from e
        return h

    def _give_back(
        self, h: Handoff | PendingHandoff, ok: bool, wait_s: float = 0.0, prompt_digest: str = ""
    ) -> None:
        """Ends the leases of a handoff this consumer will not read (its prompt is cached here,
        or the handoff was rejected): acquire, then release, since only an owner may release. A
        pending handoff's acquire waits up to ``wait_s`` for its prefill (of ``prompt_digest``'s
        prompt: another prompt's lease is not this request's to end)."""
        try:
            sources = self._sources(h)
        except Exception as e:  # a layout we cannot serve: the lease TTL frees the blocks
            logger.info("giving back transfer %s failed: %s", short_id(h.transfer_id), e)
            return
        for rank, source in sources.items():
            owner = secrets.token_bytes(OWNER_BYTES)
            try:
                address = self._producer_address(h, rank)
                timeout_s = wait_s if isinstance(h, PendingHandoff) else _RELEASE_TIMEOUT_S
                reply = self._acquire(
                    address, h, owner, source.readers, timeout_s, prompt_digest=prompt_digest
                )
                if isinstance(reply, Granted):
                    self._release(address, h.transfer_id, owner, ok)
            except Exception as e:  # the producer's lease TTL frees the blocks anyway
                logger.info("giving back transfer %s failed: %s", short_id(h.transfer_id), e)

    def _release(
        self,
        address: str,
        transfer_id: str,
        owner: bytes,
        ok: bool,
        trace: dict[str, str] | None = None,
    ) -> None:
        """Ends our lease at ``address``; ``trace``: the request's, for a ``mooncake.release``
        span (tracing on)."""
        start_ns, error = tracing.now_ns(), None
        try:
            self._client.call(
                address, Release(transfer_id, ok, owner), timeout_s=_RELEASE_TIMEOUT_S
            )
        except Exception as e:  # the producer's lease TTL frees the blocks anyway
            error = f"{type(e).__name__}: {e}"
            logger.warning("release of %s at %s failed: %s", short_id(transfer_id), address, e)
        if trace and self._tracer is not None:
            span = tracing.Span("mooncake.release", start_ns, tracing.now_ns(), {
                "mooncake.transfer_id": transfer_id, "mooncake.producer": address,
                "mooncake.ok": ok,
            }, error)  # fmt: skip
            tracing.record(self._tracer, span, trace)

    # ---- teardown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._staging_reads is not None:
            self._staging_reads.shutdown(wait=True)
        if self._releases is not None:
            self._releases.shutdown(wait=True)
        if self._claim is not None:
            self._claim.close()
        if self._marks_out is not None:
            self._marks_out.close()
        if self._client is not None:
            self._client.close()
        if self._wake is not None:
            self._wake.close()
            self._wake = None
        if self._engine is not None:
            self._engine.close()
        if self._bridge is not None:
            self._bridge.close()  # after the engine: its teardown removes keys through the bridge
