"""The consumer's pull: one ``Puller`` per consumer worker, each load one job on its thread pool.

For each producer rank holding heads this rank needs (``planning.head_sources``; any TP sizes):
``Acquire`` (side channel) → plan regions (``planning.plan_pull``; any block sizes) →
transfer-engine read → ``Release``. The job never raises; its outcome is collected on the step
thread (``WorkerHalf.get_transfer_results``), so no failure is lost. One pull's state (its
load as resolved and granted, the leases it holds, whether it succeeded) is a ``_PullState``,
whose leases are released however the pull ends.

Deadline (``load_timeout_s``) and late writes: the transfer engine cannot cancel a read. A pull
not done a quarter second past its deadline is reported failed at once (vLLM's policy then fails
or recomputes the request); its destination blocks stay pinned by the scheduler half until the
worker reports the load *settled* (``MooncakeWorkerMeta``), which happens only when its thread
has returned (``core.loads.LoadJobs``) — and ``TransferAgent.read`` returns only once every entry
it submitted has ended (a stalled entry is ended by the engine after ``stall_timeout_s`` without
progress; no attempt starts unless it can end by the deadline). A pull still in the acquire or
the engine's first handshake (which can block in C++) at the deadline submits nothing afterwards
(``LoadJob.start_writing`` decides under a lock).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from mooncake_vllm.core import tracing
from mooncake_vllm.core.auth import AuthError, Keys, open_record, short_id
from mooncake_vllm.core.kv_groups import KVGroup
from mooncake_vllm.core.loads import LoadJob, LoadJobs, LoadOutcome, MooncakeWorkerMeta
from mooncake_vllm.core.registry import (
    decode_record,
    registry_key,
)
from mooncake_vllm.p2p.config import ConnectorConfig
from mooncake_vllm.p2p.protocol import (
    ALL_LAYERS,
    OWNER_BYTES,
    Acquire,
    Await,
    Granted,
    Handoff,
    HandoffError,
    PendingHandoff,
    Refused,
    Release,
)
from mooncake_vllm.p2p.reads import (
    Pull,
    PullFailed,
    Reader,
    Source,
    Totals,
    check_trusted,
    init_pull_thread,
)
from mooncake_vllm.p2p.side_channel import CallCancelled, SideChannelClient, SideChannelError
from mooncake_vllm.p2p.step_metadata import LoadSpec
from mooncake_vllm.p2p.upstream import BootstrapError, BootstrapResolver
from mooncake_vllm.transfer.store_bridge import MetadataBridge

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 2.0
_PENDING_MARGIN_S = 0.5  # a pending acquire's wait at the producer ends this much earlier
_PULL_THREADS = 8  # pulls mostly sleep (side channel, status polls); a stuck one must not queue


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
class _PullState:
    """One pull's state across its producer ranks: the load (its handoff resolved, then
    granted), the leases acquired (side channel -> the owner token that releases it), whether
    it succeeded (what the releases report), and when its own time started."""

    load: LoadSpec
    start: float
    acquired: dict[str, bytes] = dataclasses.field(default_factory=dict)
    succeeded: bool = False

    @property
    def handoff(self) -> Handoff | PendingHandoff | None:
        return self.load.handoff


class Puller:
    """A consumer worker's pulls: submitted by ``WorkerHalf.start_load_kv``, their outcomes
    collected by its ``get_transfer_results``. ``attach`` gives it what the worker registered
    (the transfer engine, this rank's segments and layers, the metadata bridge)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        tp_rank: int,
        rank: int,
        keys: Keys,
        wake: Callable[[], None],
        kv_replicated: bool = False,
        kv_heads: int = 1,
        block_size: int | None = None,
        kv_groups: tuple[KVGroup, ...] = (KVGroup(()),),
    ):
        self._cfg = cfg
        # vLLM's --otlp-traces-endpoint: a span per pull and per release; None: off.
        self._tracer = tracing.tracer(cfg.otlp_traces_endpoint, tracing.CONNECTOR_SERVICE, "grpc")
        self._rank = rank  # the worker rank (``ConnectorConfig.rank``)
        # A grant while the prefill computes names written layers in the producer's segment
        # order; a consumer of several pipeline stages holds other segments: it is granted once
        # every layer is written.
        self._layers_ok = cfg.pp_size == 1
        self._keys = keys
        self._reader = Reader(cfg, tp_rank, kv_replicated, kv_heads, block_size, kv_groups)
        self._bridge: MetadataBridge | None = None  # set by ``attach``
        # Pending pulls (waiting for their prefill), set when vLLM finished their request.
        self._cancels: dict[str, threading.Event] = {}
        # Pending handoffs named by their producer's bootstrap (upstream's convention).
        self._bootstraps = BootstrapResolver()
        self._client = SideChannelClient(keys)
        self._pool = ThreadPoolExecutor(
            _PULL_THREADS, thread_name_prefix="mooncake-pull", initializer=init_pull_thread
        )
        self._pulls: LoadJobs[PullOutcome] = LoadJobs(self._pool, noun="pull", wake=wake)
        # Releases go out beside the pulls: a producer that does not answer must not delay
        # the outcome vLLM waits for (its lease TTL frees the blocks anyway).
        self._releases = ThreadPoolExecutor(1, thread_name_prefix="mooncake-release")

    @property
    def reader(self) -> Reader:
        """This rank's layout and reads (``Reader.attach`` once the KV cache is registered)."""
        return self._reader

    def use_registry(self, bridge: MetadataBridge | None) -> None:
        """``bridge``: where producers the handoff does not locate are looked up."""
        self._bridge = bridge

    # ---- every step ----------------------------------------------------------------------

    def submit(self, load: LoadSpec) -> None:
        if isinstance(load.handoff, PendingHandoff):
            self._cancels[load.req_id] = threading.Event()
        # vLLM waits for no outcome of a load without blocks: its lease is only released.
        self._pulls.submit(
            load.req_id,
            partial(self._pull, load),
            self._cfg.settings.load_timeout_s,
            awaited=load.fills_blocks,
        )

    def cancel(self, req_id: str) -> None:
        """vLLM finished a request whose pending pull may still wait for its prefill."""
        if (event := self._cancels.get(req_id)) is not None:
            event.set()

    def collect(self) -> list[PullOutcome]:
        """The outcomes of the pulls that ended (or are overdue) since the last call."""
        return self._pulls.collect(self._overdue)

    def running(self) -> int:
        return self._pulls.running()

    def worker_meta(self) -> MooncakeWorkerMeta | None:
        return self._pulls.worker_meta()

    def take_rejected(self) -> int:
        """Side-channel frames rejected since the last call (bad signature or shape)."""
        return self._client.take_rejected()

    def _overdue(self, job: LoadJob[PullOutcome]) -> PullOutcome:
        stage = "acquire or first handshake" if job.abandon() else "read"
        reason = (
            f"not done {self._cfg.settings.load_timeout_s:g}s (load_timeout_s) after it "
            f"started, still in the {stage}; its blocks stay pinned until it has ended"
        )
        return PullOutcome(job.req_id, ok=False, reason=reason)

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
                self._give_back(h, load.error is None, deadline - start, load.prompt_digest)
            return PullOutcome(load.req_id, ok=True)
        state = _PullState(load, start)
        try:
            return self._acquire_and_read(state, job)
        except CallCancelled as e:
            return PullOutcome(load.req_id, ok=False, reason=str(e), cancelled=True)
        except Exception as e:
            return PullOutcome(load.req_id, ok=False, reason=f"{type(e).__name__}: {e}")
        finally:
            for address, owner in state.acquired.items():
                assert state.handoff is not None
                self._releases.submit(
                    self._release,
                    address,
                    state.handoff.transfer_id,
                    owner,
                    state.succeeded,
                    state.load.trace,
                )

    def _acquire_and_read(self, state: _PullState, job: LoadJob[PullOutcome]) -> PullOutcome:
        """Every producer rank's lease acquired (into ``state.acquired``) and read; raises on
        failure, answers a refusal."""
        load = state.load
        if load.error is not None:
            if load.handoff is not None:  # rejected (e.g. another model's KV): free its lease
                self._releases.submit(self._give_back, load.handoff, False)
            raise PullFailed(load.error)
        assert load.handoff is not None and self._reader.attached
        out = Totals()
        covered: set[int] = set()  # our segments the grants read from hold
        sources = self._reader.sources(load.handoff)
        last = max(sources)
        for rank, source in sources.items():
            refused = self._pull_from(state, job, out, (rank, source, rank == last), covered)
            if refused is not None:
                return PullOutcome(load.req_id, ok=False, reason=refused.reason, refused=True)
        state.succeeded = True
        load = state.load
        logger.debug(
            "request %s: pulled %d blocks (%d B, %d entries) from %d producer rank(s): "
            "acquire %.1f ms, read %.1f ms",
            load.req_id,
            load.num_blocks,
            out.nbytes,
            out.entries,
            len(state.acquired),
            1000 * out.acquire_s,
            1000 * out.read_s,
        )
        start = state.start
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

    def _pull_from(
        self,
        state: _PullState,
        job: LoadJob[PullOutcome],
        out: Totals,
        at: tuple[int, Source, bool],
        covered: set[int],
    ) -> Refused | None:
        """At producer rank ``rank`` (``at``: the rank, what to read there, whether it is the
        last rank), the lease acquired and its heads read; a pending handoff becomes the granted
        one in ``state.load``; ``covered`` gains the segments of ours its grant holds. The
        refusal, if refused."""
        rank, source, last = at
        h = state.handoff
        assert h is not None
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
                source.readers,
                job.deadline_s - asked_at,
                self._cancels.get(state.load.req_id),
                state.load.prompt_digest,
            )
        except SideChannelError:
            if pending:  # the wait still stands at the producer: the release withdraws it
                state.acquired[address] = owner
            raise
        if pending:  # it waited for the prefill: not the pull's time
            state.start = time.monotonic()
        else:
            out.acquire_s += time.monotonic() - asked_at
        if isinstance(reply, Refused):
            return reply
        state.acquired[address] = owner
        if isinstance(h, PendingHandoff):
            h = self._granted_handoff(h, reply, state.load)
            state.load = dataclasses.replace(
                state.load, handoff=h, remote_block_ids=h.remote_block_ids
            )
        held = self._reader.stage_segments(reply) if source.heads else None
        pull = Pull(state.load, h, job, out, held)
        if source.heads:
            covered |= self._reader.all_segments() if held is None else set(held)
        if last:  # every stage's layers known: before the last read
            self._reader.check_covered(covered, h)
        if reply.ready != ALL_LAYERS:  # the prefill computes: take layers as they come
            await_layers = partial(self._await_layers, address, owner, pull)
            self._reader.read_layers(pull, source.tp_rank, source.heads, reply, await_layers)
        elif source.heads:
            self._reader.read(pull, source.tp_rank, source.heads, reply)
        return None

    def _await_layers(
        self, address: str, owner: bytes, pull: Pull, known: int, wait_s: float
    ) -> object:
        """Asks the producer for the layers written past ``known`` (``Await``), waiting up to
        ``wait_s`` (its answer comes a little earlier, so the reason arrives)."""
        wait_ms = int(max(0.1, wait_s - _PENDING_MARGIN_S) * 1000)
        return self._client.call(
            address,
            Await(pull.handoff.transfer_id, owner, known, wait_ms),
            timeout_s=max(0.1, wait_s),
            cancelled=self._cancels.get(pull.load.req_id),
        )

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
        check_trusted(self._cfg, h.side_channel_host, "the side channel the bootstrap names,")
        return dataclasses.replace(load, handoff=h)

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
        check_trusted(self._cfg, record.side_channel.rpartition(":")[0], "registry side channel")
        return record.side_channel

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
            if load.checks is None:
                raise HandoffError("a pending handoff's load carries no checks")
            load.checks.validate(h)
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
            sources = self._reader.sources(h)
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
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reader.shutdown()
        self._releases.shutdown(wait=True)
        self._client.close()
