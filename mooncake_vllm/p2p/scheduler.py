"""The scheduler half: runs in vLLM's engine-core process, decides, never moves bytes.

Producer: ``request_finished`` keeps the prompt's blocks of every request whose prompt KV is
complete (length cap and stop/EOS alike), opens a lease for them through the next step's metadata,
and returns the ``Handoff`` as ``kv_transfer_params``. With ``layerwise_handoff`` the lease opens
earlier, computing, in the step that completes the prompt (``build_connector_meta``), so that a
decode waiting on it (a pending handoff) reads each layer as the workers write it;
``request_finished`` then finishes it, or aborts it.

Consumer: ``get_num_new_matched_tokens`` claims the prompt tokens the local prefix cache lacks as
an asynchronous external load; ``update_state_after_alloc`` validates the handoff and records the
destination blocks. A handoff that fails validation is still claimed and then reported failed by
the worker (which reads nothing and releases the producer's lease), so vLLM's
``kv_load_failure_policy`` (recompute or fail) decides for every bad handoff alike.

Late writes: the transfer engine cannot cancel a read, and a pull can be reported failed at its
deadline while entries are still in flight (a frozen producer). The destination blocks are
therefore pinned in vLLM's block pool (one extra reference, as vLLM's own offload connector
protects blocks under a store) from planning until every worker rank reports the load settled
(all its entries ended): whatever vLLM does with the request meanwhile — fail it, recompute it
into fresh blocks, abort it — those blocks are not handed to another request.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import zmq
from vllm.v1.request import RequestStatus

from mooncake_vllm.core import tracing
from mooncake_vllm.core.auth import host_allowed, short_id
from mooncake_vllm.core.kv_groups import (
    GroupError,
    KVGroup,
    WindowKeeper,
    claim_hold_back,
    positions_to_fill,
)
from mooncake_vllm.core.loads import BlockPins, MooncakeWorkerMeta
from mooncake_vllm.core.planning import REBLOCKABLE
from mooncake_vllm.core.settings import ConfigError
from mooncake_vllm.p2p.bootstrap import BootstrapRegistration, BootstrapService, bootstrap_url
from mooncake_vllm.p2p.config import ConnectorConfig
from mooncake_vllm.p2p.leases.client import LeaseService, RankLayout
from mooncake_vllm.p2p.local_channels import WakeForwarder, wake_endpoint
from mooncake_vllm.p2p.params import asks_remote_decode, asks_remote_prefill, param_type_error
from mooncake_vllm.p2p.protocol import (
    Handoff,
    HandoffChecks,
    HandoffError,
    PendingHandoff,
    is_transfer_id,
    request_prompt_digest,
)
from mooncake_vllm.p2p.stats import MooncakeStats
from mooncake_vllm.p2p.step_metadata import GroupLoad, LoadSpec, MooncakeConnectorMetadata
from mooncake_vllm.p2p.upstream import (
    bootstrap_host,
    is_upstream,
    parse_consumer_params,
    producer_params,
    to_pending,
)
from mooncake_vllm.vllm_glue import (
    IDLE_STEP_PAUSE_S,
    EngineCoreHandle,
    Probe,
    Rests,
    request_family,
)

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# A finished request whose prompt KV is complete: its blocks can be handed over.
_HANDOVER_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


# Leases whose span is waiting for their end; the oldest is dropped past this (a lease that
# never reports its end costs one entry, not memory without bound).
MAX_TRACED_LEASES = 4096


class SchedulerHalf:
    def __init__(
        self,
        cfg: ConnectorConfig,
        block_size: int,
        compat_hash: str,
        remember_ids: int = 65536,
        *,
        kv_layout: str = "",
        kv_replicated: bool = False,
        kv_heads: int = 1,
        kv_format: str = "",
        probe: Probe | None = None,
        kv_groups: tuple[KVGroup, ...] = (KVGroup(()),),
    ):
        """``kv_heads``: the model's KV heads, all ranks (1 for an MLA latent). ``probe``: what
        ``vllm_glue.check_vllm`` found (None: look for the engine core). ``kv_groups``: the KV
        cache groups (``core.kv_groups``; one unless vLLM's hybrid allocator splits the
        model's layers by kind of attention)."""
        self._cfg = cfg
        # vLLM's --otlp-traces-endpoint: a span per lease (producer) and per pull (consumer,
        # from the worker); None: off, nothing imported.
        self._tracer = tracing.tracer(cfg.otlp_traces_endpoint, tracing.CONNECTOR_SERVICE, "grpc")
        # Producer, tracing on: req id -> (trace context, start ns, transfer id, blocks).
        self._lease_spans: OrderedDict[str, tuple[dict[str, str], int, str, int]] = OrderedDict()
        self._groups = kv_groups
        self._hold_back = claim_hold_back(kv_groups)
        # Producer: the sliding-window blocks a consumer's first token needs, kept past the
        # request (``kv_groups.WindowKeeper``).
        self._keeper = WindowKeeper(kv_groups, block_size)
        self._kv_heads = kv_heads
        self._kv_format = kv_format
        # Handoffs of another block size are re-blocked where both sides keep this format.
        reblocks = kv_format == REBLOCKABLE and cfg.settings.reblock_buffer_bytes > 0
        self._reblock_format = kv_format if reblocks else ""
        self._block_size = block_size
        self._compat_hash = compat_hash
        self._kv_layout = kv_layout
        self._kv_replicated = kv_replicated
        self._loads: dict[str, LoadSpec] = {}
        # Consumer: blocks under a pull (None until vLLM binds its block pool).
        self._pins: BlockPins | None = None
        self._engine_core = EngineCoreHandle.find(probe)
        self._rests = Rests(self._engine_core)
        # Producer: leases and side channels, in a process of their own (leases.client).
        self._leases: LeaseService | None = None
        # Producer: vLLM's upstream bootstrap HTTP service (``GET /query``), beside the leases;
        # another local DP rank's registration with it.
        self._bootstrap: BootstrapService | BootstrapRegistration | None = None
        if cfg.is_producer:
            self._leases = LeaseService(
                cfg, wake_endpoint(cfg.host, cfg.base_port), kv_replicated=kv_replicated
            )
            if cfg.serves_bootstrap:
                try:
                    self._bootstrap = BootstrapService(cfg)
                except ConfigError as e:
                    if cfg.bootstrap_port_set or cfg.dp_local_rank != 0:
                        self._leases.close()
                        raise
                    # Upstream's default port, taken (another producer on this host): serve
                    # without a bootstrap. Our proxy and the NIXL-style flow never ask one.
                    logger.warning(
                        "%s. This engine serves no bootstrap /query (orchestrators that read "
                        "one, e.g. vLLM's router with --kv-connector mooncake, cannot use it); "
                        "our proxy and handoffs in kv_transfer_params work as before",
                        e,
                    )
                    self._cfg = cfg = dataclasses.replace(cfg, bootstrap_port=0)
                except BaseException:
                    self._leases.close()
                    raise
            elif cfg.bootstrap_port:
                self._bootstrap = BootstrapRegistration(cfg)
        self._waker: WakeForwarder | None = None
        if self._engine_core is not None:
            try:
                self._waker = WakeForwarder(
                    wake_endpoint(cfg.host, cfg.base_port), self._wake_engine_core
                )
            except zmq.ZMQError as e:  # cannot rest without it: pause idle steps instead
                logger.warning("wake-up socket unavailable (%s): idle steps are paused", e)
        # Consumer: one pull per transfer id (bounded), shared by vLLM's n > 1 children of one
        # request; any other request with a known id is refused. See
        # ``get_num_new_matched_tokens``.
        self._shared: OrderedDict[str, SharedPull] = OrderedDict()
        self._pulling: dict[str, str] = {}  # puller's req id -> its transfer id, until settled
        self._following: set[str] = set()  # requests told to ask again (a pull is in flight)
        # Requests whose pull waits for its prefill (a pending handoff), until settled; those
        # vLLM finished meanwhile, for the next step's metadata.
        self._pending_loads: set[str] = set()
        # Requests claimed only to be refused through the policy (a wrongly typed field, a
        # connector error), until ``update_state_after_alloc`` plans their failed load.
        self._refused: dict[str, str] = {}
        self._cancelled: set[str] = set()
        self._remember_ids = remember_ids
        # Producer: the transfer ids it has used (bounded), never taken again from a client.
        self._issued: OrderedDict[str, None] = OrderedDict()
        # Producer, ``layerwise_handoff``: requests to hand over, until their last prefill step
        # is scheduled; then the handoff of their lease opened computing, until they finish.
        self._layerwise = cfg.is_producer and cfg.settings.layerwise_handoff
        self._producing: dict[str, Request] = {}
        self._early: dict[str, Handoff] = {}

    # ---- consumer ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The prompt tokens to load, for the first request that carries a transfer id.

        A transfer is pulled once. vLLM fans ``n > 1`` out into children that carry the same
        ``kv_transfer_params``; the first to get here pulls, and the others follow: they wait
        (None: vLLM asks again next step) while the pull is in flight, then take what the
        local prefix cache holds (the pulled blocks, cached when the first was promoted) and
        compute the rest; if the pull failed they fail with it, through vLLM's policy.

        Any other request that carries a transfer id this consumer knows (an orchestrator that
        sent one id with two requests, at once or one after the other) is claimed and refused
        (``_check``): vLLM's policy decides, and it never touches the lease.

        So is a request whose ``kv_transfer_params`` do not type-check (``params``), and one
        this hook fails on for any other reason: nothing here raises into vLLM's scheduler,
        which has no handler around it (an exception would end the engine core)."""
        params = request.kv_transfer_params
        if not (self._cfg.is_consumer and asks_remote_prefill(params)):
            return 0, False
        try:
            return self._matched_tokens(request, params, num_computed_tokens)
        except Exception as e:
            logger.exception("request %s: refused, connector error", request.request_id)
            self._refuse(request.request_id, f"connector error while matching: {e!r}")
            return self._claim(request, num_computed_tokens)

    def _matched_tokens(
        self, request: Request, params: dict[str, Any], num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        if is_upstream(params):
            try:
                to_pending(params)
            except HandoffError as e:
                # No usable transfer id, engine id or bootstrap address: vLLM's upstream
                # connector computes such a prompt, and so does this one (nothing is claimed).
                logger.warning("request %s: not pulled, the prompt is computed here: %s", req_id, e)
                params["do_remote_prefill"] = False
                return 0, False
        error = param_type_error(params)
        if error is not None:
            self._refuse(req_id, error)  # claimed, then failed by the worker (the policy)
            return self._claim(request, num_computed_tokens)
        shared = self._shared.get(params.get("transfer_id"))  # type: ignore[arg-type]
        if shared is not None and shared.puller != req_id and shared.shared_by(request):
            if shared.state == "pulling":
                self._following.add(req_id)
                return None, False
            self._following.discard(req_id)
            if shared.state == "done":
                params["do_remote_prefill"] = False  # never pulls, never touches the lease
                return 0, False
        return self._claim(request, num_computed_tokens)

    def _claim(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt tokens the local prefix cache lacks, as an asynchronous external load
        (less the last one for a model with a sliding window: ``kv_groups.claim_hold_back``)."""
        count = request.num_prompt_tokens - self._hold_back - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _refuse(self, req_id: str, reason: str) -> None:
        """Fail ``req_id``'s load, once vLLM has given it blocks, with ``reason``."""
        self._refused[req_id] = reason
        while len(self._refused) > self._remember_ids:  # claimed, never given blocks
            self._refused.pop(next(iter(self._refused)))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if self._layerwise and asks_remote_decode(params):
            self._producing[request.request_id] = request
        if not (self._cfg.is_consumer and asks_remote_prefill(params)):
            return
        # Called again once the load is done: this flag makes that call (and any later
        # get_num_new_matched_tokens) a no-op.
        params["do_remote_prefill"] = False
        try:
            self._plan_load(request, params, blocks, num_external_tokens)
        except Exception as e:
            # Never into vLLM's scheduler. A claimed load must still end (vLLM waits for its
            # outcome): the worker reports it failed, and the policy decides.
            req_id = request.request_id
            logger.exception("request %s: refused, connector error", req_id)
            if num_external_tokens > 0:
                local = [b.block_id for b in blocks.blocks[0] if b.block_hash is None]
                error = f"connector error while planning the load: {e!r}"
                self._loads[req_id] = LoadSpec(req_id, None, [], local, error)
            self._settle_shared(req_id, failed=True)

    def _plan_load(
        self,
        request: Request,
        params: dict[str, Any],
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        req_id = request.request_id
        refused = self._refused.pop(req_id, None)
        handoff, error = (None, refused) if refused else self._check(request, params)
        if num_external_tokens == 0:
            # The local prefix cache holds the whole prompt: nothing to pull, free the lease.
            if error is not None:
                logger.warning("request %s: handoff rejected (nothing to pull): %s", req_id, error)
            if handoff is not None:
                checks = self._checks(request)
                self._loads[req_id] = LoadSpec(
                    req_id, handoff, [], [], error, checks=checks, trace=self._trace_of(request)
                )
            self._settle_shared(req_id, failed=False)  # vLLM waits for no outcome
            return
        end, size = request.num_prompt_tokens - self._hold_back, self._block_size
        fills: list[tuple[int, list[int]]] = []
        for g, group in enumerate(self._groups):
            try:
                fills.append(positions_to_fill(blocks.blocks[g], group, end, size))
            except GroupError as e:
                fills.append((0, [b.block_id for b in blocks.blocks[g] if b.block_hash is None]))
                error = error or (f"KV cache group {g}: {e}" if len(self._groups) > 1 else str(e))
        first, local_block_ids = fills[0]
        others = [GroupLoad(ids, start * size) for start, ids in fills[1:]]
        if error is not None:
            logger.warning("request %s: handoff rejected: %s", req_id, error)
        pending = isinstance(handoff, PendingHandoff)
        if pending and error is None:
            self._pending_loads.add(req_id)
        self._loads[req_id] = LoadSpec(
            req_id,
            handoff,
            handoff.remote_block_ids if handoff and not pending else [],
            local_block_ids,
            error,
            first_token=first * size,
            checks=self._checks(request) if pending else None,
            groups=others,
            end_token=end if self._hold_back else 0,
            trace=self._trace_of(request),
        )
        if self._pins is not None:
            self._pins.pin(req_id, local_block_ids + [b for g in others for b in g.local_block_ids])

    def bind_block_pool(self, pool: BlockPool) -> None:
        if self._cfg.is_producer and self._keeper.active:
            self._keeper.bind(pool)
        if self._cfg.is_consumer:
            self._pins = BlockPins(pool, self._cfg.ranks)  # every worker settles a load

    def has_pending_work(self) -> bool:
        """Loads still pinned: vLLM must keep stepping (resting in between) until the workers
        report them settled, even when no request is left."""
        return bool(self._pins)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if self._pins is not None and isinstance(meta, MooncakeWorkerMeta):
            self._pins.settle(meta.settled)
        failed = output.failed_recving or set()
        for req_id in output.finished_recving or ():
            self._pending_loads.discard(req_id)
            self._settle_shared(req_id, failed=req_id in failed)

    def _settle_shared(self, req_id: str, failed: bool) -> None:
        """A puller's load has an outcome: the requests following its transfer may go on."""
        transfer_id = self._pulling.pop(req_id, None)
        if transfer_id is not None and (shared := self._shared.get(transfer_id)) is not None:
            shared.state = "failed" if failed else "done"

    def _checks(self, request: Request) -> HandoffChecks:
        """What a handoff for ``request`` is checked against on this consumer."""
        return HandoffChecks(
            prompt_len=request.num_prompt_tokens,
            compat_hash=self._compat_hash,
            kv_heads=self._kv_heads,
            tp_size=self._cfg.tp_size,
            block_size=self._block_size,
            kv_layout=self._kv_layout,
            reblock_format=self._reblock_format,
            prompt_digest=request_prompt_digest(request),
            kv_groups=len(self._groups),
        )

    def _check(
        self, request: Request, params: dict[str, Any]
    ) -> tuple[Handoff | PendingHandoff | None, str | None]:
        """The handoff (None when it must not be acted on) and the rejection reason, if any. A
        pending handoff is checked by the worker, once its grant has brought the rest."""
        try:
            handoff = parse_consumer_params(params)
            host = handoff.side_channel_host
            if isinstance(handoff, PendingHandoff) and handoff.unresolved:
                # Named by its bootstrap (upstream's convention): the worker resolves it there.
                host = bootstrap_host(handoff.bootstrap_addr)
        except HandoffError as e:
            return None, str(e)
        trusted = self._cfg.settings.trusted_producers
        if trusted is not None and host and not host_allowed(host, trusted):
            # Not even a release: nothing is sent to a host we do not trust.
            return None, (
                f"producer {host!r} is not in trusted_producers {trusted}; add it there to "
                "pull from it"
            )
        shared = self._shared.get(handoff.transfer_id)
        if shared is not None and shared.puller != request.request_id:
            # Do not touch the producer's lease: it belongs to the puller.
            tid = short_id(handoff.transfer_id)
            if not shared.shared_by(request):
                return None, (
                    f"transfer_id {tid} was used before on this consumer by request "
                    f"{shared.puller} ({'still pulling' if shared.state == 'pulling' else 'ended'})"
                    "; refused (choose a new transfer_id for every request)"
                )
            # A follower of a pull that failed (``get_num_new_matched_tokens``).
            return None, f"the pull of transfer {tid} this request shares ({shared.puller}) failed"
        self._shared[handoff.transfer_id] = SharedPull.of(request)
        self._pulling[request.request_id] = handoff.transfer_id
        while len(self._shared) > self._remember_ids:
            self._shared.popitem(last=False)
        if isinstance(handoff, PendingHandoff):
            return handoff, None
        try:
            self._checks(request).validate(handoff)
        except HandoffError as e:
            return handoff, str(e)  # still release the producer's lease
        return handoff, None

    # ---- producer ------------------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: list[int], groups: Sequence[list[int]] = ()
    ) -> tuple[bool, dict[str, Any] | None]:
        """``groups``: the blocks of KV cache groups 1.. (``block_ids`` are group 0's) of a
        hybrid model, each a positional list with null blocks where a sliding window freed
        them; they go out in the handoff and are held with the lease."""
        self._following.discard(request.request_id)  # a follower aborted while it waited
        self._refused.pop(request.request_id, None)  # finished before its blocks were given
        if request.request_id in self._pending_loads:  # aborted while its prefill computes
            self._pending_loads.discard(request.request_id)
            self._cancelled.add(request.request_id)
        params = request.kv_transfer_params
        if not (self._cfg.is_producer and asks_remote_decode(params)):
            self._keeper.forget(request.request_id)
            return False, None
        self._producing.pop(request.request_id, None)
        error = param_type_error(params)
        if error is not None:
            # A decode told of this transfer would wait for a lease that never comes: say why.
            # (No lease opened computing: ``_open_computing`` checks the same.)
            logger.warning("request %s: not handed over: %s", request.request_id, error)
            return False, None
        early = self._early.pop(request.request_id, None)
        prompt_len = request.num_prompt_tokens
        num_blocks = -(-prompt_len // self._block_size)
        complete = (
            request.status in _HANDOVER_STATUSES and request.num_computed_tokens >= prompt_len
        )
        if early is not None:
            return self._finish_early(request, early, list(block_ids[:num_blocks]), complete)
        if not complete:
            return False, None  # aborted or incomplete: nothing to hand over, free now
        if len(block_ids) < num_blocks:
            logger.warning(
                "request %s: %d blocks for %d tokens",
                request.request_id,
                len(block_ids),
                prompt_len,
            )
            return False, None
        transfer_id = self._new_transfer_id(request.request_id, params.get("transfer_id"))
        if transfer_id is None:
            return False, None
        prompt_block_ids = list(block_ids[:num_blocks])
        if len(groups) != len(self._groups) - 1:
            logger.warning(
                "request %s: blocks of %d KV cache groups, this engine has %d; not handed over",
                request.request_id,
                len(groups) + 1,
                len(self._groups),
            )
            return False, None
        extra = [list(g[:num_blocks]) for g in groups]
        self._keeper.keep(request, [prompt_block_ids, *extra])
        handoff = self._handoff(request, transfer_id, prompt_block_ids, extra)
        # Held before the handoff leaves this process: an acquire never waits for a step (and a
        # pending one, sent with the prefill leg, is answered by this hold).
        if not self._leases.hold(request.request_id, transfer_id, prompt_block_ids, handoff):
            self._keeper.release([request.request_id])
            return False, None
        self._lease_opened(request, transfer_id, len(prompt_block_ids))
        return True, self._answer(handoff)

    def _finish_early(
        self, request: Request, handoff: Handoff, block_ids: list[int], complete: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` for a lease opened computing: hold the blocks and hand over, or
        (aborted, or not the blocks it was opened on) keep them until its readers are done."""
        assert self._leases is not None
        req_id, tid = request.request_id, handoff.transfer_id
        if complete and block_ids == handoff.remote_block_ids:
            if self._leases.hold(req_id, tid, block_ids, handoff):
                self._lease_opened(request, tid, len(block_ids))
                return True, self._answer(handoff)
            return False, None  # the lease server is gone: no consumer can read these blocks
        if complete:
            logger.error(
                "request %s: prompt blocks %s at the end, %s when its lease opened; not handed "
                "over",
                req_id,
                block_ids,
                handoff.remote_block_ids,
            )
        self._leases.abort(req_id, tid, handoff.remote_block_ids)
        return True, None  # freed once the lease has ended (``take_finished``)

    # ---- spans (vLLM's --otlp-traces-endpoint) -----------------------------------------------

    def _trace_of(self, request: Request) -> dict[str, str]:
        """The request's trace context when tracing is on ({} otherwise: no spans)."""
        if self._tracer is None:
            return {}
        return tracing.trace_headers(getattr(request, "trace_headers", None))

    def _lease_opened(self, request: Request, transfer_id: str, blocks: int) -> None:
        trace = self._trace_of(request)
        if not trace:
            return
        self._lease_spans[request.request_id] = (trace, tracing.now_ns(), transfer_id, blocks)
        while len(self._lease_spans) > MAX_TRACED_LEASES:
            self._lease_spans.popitem(last=False)

    def _lease_ended(self, finished: set[str], reasons: dict[str, str]) -> None:
        """A ``mooncake.lease`` span per traced lease that ended: held from the prefill's end
        to the consumer's release (or expiry, eviction, abort), with the reason."""
        for req_id in finished:
            opened = self._lease_spans.pop(req_id, None)
            if opened is None:
                continue
            trace, start_ns, transfer_id, blocks = opened
            reason = reasons.get(req_id, "unknown")
            span = tracing.Span("mooncake.lease", start_ns, tracing.now_ns(), {
                "mooncake.transfer_id": transfer_id, "mooncake.request_id": req_id,
                "mooncake.blocks": blocks, "mooncake.lease.end_reason": reason,
            })  # fmt: skip
            if reason not in ("released", "aborted"):
                span.error = f"lease {reason}"
            tracing.record(self._tracer, span, trace)

    def _open_computing(self, scheduler_output: SchedulerOutput) -> list[str]:
        """``layerwise_handoff``: opens a lease, computing, for a request to hand over whose
        prompt this step computes whole and alone, with no request queued behind it, and which
        ends with this step (``max_tokens`` 1, a prefill leg: nothing writes or frees its blocks
        afterwards, so its KV is complete once every layer is written); its transfer id, for
        the workers' marks. Then the step's compute leaves the host's other cores idle and a
        consumer reading beside it costs nobody; with prompts sharing the step or queued behind
        it, reads during the step slow the compute they all wait for (measured,
        docs/benchmarks.md). Any other request to hand over is held when it finishes, as without
        the setting (so is a prompt prefilled in chunks, or resumed)."""
        candidates, self._producing = self._producing, {}
        new = next((n for n in scheduler_output.scheduled_new_reqs if n.req_id in candidates), None)
        if new is None:
            return []
        request = candidates[new.req_id]
        scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
        prompt_len = request.num_prompt_tokens
        num_blocks = -(-prompt_len // self._block_size)
        block_ids = list(new.block_ids[0][:num_blocks])
        if (
            getattr(request.sampling_params, "max_tokens", None) != 1
            or new.num_computed_tokens + scheduled < prompt_len
            or scheduler_output.total_num_scheduled_tokens != scheduled
            or len(block_ids) < num_blocks
            or (self._engine_core is not None and self._engine_core.queued())
        ):
            return []
        params = request.kv_transfer_params or {}
        if param_type_error(params) is not None:
            return []  # refused when it finishes (``request_finished`` says why)
        tid = self._new_transfer_id(new.req_id, params.get("transfer_id"))
        if tid is None:
            return []
        handoff = self._handoff(request, tid, block_ids)
        if not self._leases.hold(new.req_id, tid, block_ids, handoff, computing=True):
            return []
        self._early[new.req_id] = handoff
        return [tid]

    def _handoff(
        self,
        request: Request,
        transfer_id: str,
        block_ids: list[int],
        groups: list[list[int]] | None = None,
    ) -> Handoff:
        return Handoff(
            transfer_id=transfer_id,
            producer_engine_id=self._cfg.engine_id,
            side_channel_host=self._cfg.host,
            side_channel_ports=[self._cfg.side_channel_port(r) for r in range(self._cfg.ranks)],
            producer_tp_size=self._cfg.tp_size,
            producer_pp_size=self._cfg.pp_size,
            remote_block_ids=block_ids,
            group_block_ids=groups or [],
            prompt_len=request.num_prompt_tokens,
            block_size=self._block_size,
            compat_hash=self._compat_hash,
            kv_layout=self._kv_layout,
            kv_format=self._kv_format,
            producer_incarnation=self._leases.incarnation,
            prompt_digest=request_prompt_digest(request),
        )

    def _answer(self, handoff: Handoff) -> dict[str, Any]:
        """``kv_transfer_params`` for the prefill's response, usable in both conventions."""
        url = bootstrap_url(self._cfg.bootstrap_listen_host, self._cfg.bootstrap_port)
        return producer_params(handoff, url if self._cfg.bootstrap_port else "")

    def _new_transfer_id(self, req_id: str, asked: object) -> str | None:
        """The id that names a lease on the side channel: the client's, if it chose one
        (``protocol.is_transfer_id``: our proxy's ``--dispatch concurrent``, upstream's
        orchestrators, which send it to the decode too); else a new random one. None (refused:
        not handed over) for a client's id this producer has used before, while its lease lives
        or after it ended: a decode waiting for it must not get another prompt's KV, nor wait
        for a lease that never comes back."""
        if is_transfer_id(asked):
            if asked in self._issued:
                logger.warning(
                    "request %s: transfer_id %s was used before on this producer; refused, not "
                    "handed over (choose a new transfer_id for every request)",
                    req_id,
                    short_id(asked),
                )
                return None
            transfer_id = str(asked)
        else:
            transfer_id = secrets.token_hex(16)
        self._issued[transfer_id] = None
        while len(self._issued) > self._remember_ids:
            self._issued.popitem(last=False)
        return transfer_id

    def set_layouts(self, layouts: dict[int, RankLayout]) -> None:
        """Every worker rank's transfer-engine segment and KV layout (vLLM's handshake)."""
        if self._leases is not None:
            self._leases.set_layouts(layouts)

    # ---- every step ----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(loads=list(self._loads.values()))
        self._loads = {}
        meta.cancelled, self._cancelled = self._cancelled, set()
        if self._leases is not None:
            meta.finished_sending = self._leases.take_finished()
            ended = self._leases.take_ended_reasons()  # taken every step: it stays bounded
            if self._lease_spans:
                self._lease_ended(meta.finished_sending, ended)
            if self._keeper.active:
                self._keeper.release(meta.finished_sending)
                self._track(scheduler_output)
            if self._producing:
                meta.layer_marks = self._open_computing(scheduler_output)
                meta.layers_token = self._leases.layers_token
        if (
            meta.loads
            or meta.finished_sending
            or meta.cancelled
            or scheduler_output.total_num_scheduled_tokens
        ):
            return meta
        if self._waker is None or self._engine_core is None:
            # vLLM steps back to back while a finished request's blocks are held or a request
            # waits for its KV: unthrottled, that burns a core in engine core and worker alike.
            time.sleep(IDLE_STEP_PAUSE_S)
        elif not scheduler_output.finished_req_ids and not self._engine_core.busy_with_others(
            self._following
        ):
            # Nothing can run until a worker reports (a pull ends, a lease ends); a new
            # request ends the rest too.
            self._rest()
        return meta

    def _track(self, scheduler_output: SchedulerOutput) -> None:
        """Producer with a sliding window: every request's blocks as this step gives them."""
        for new in scheduler_output.scheduled_new_reqs:
            self._keeper.track(new.req_id, new.block_ids, new=True)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
            self._keeper.track(req_id, ids, new=req_id in cached.resumed_req_ids)

    def _rest(self) -> None:
        """Do not let vLLM step until a worker has something to report or a request arrives.

        vLLM steps every millisecond while leases are held or loads pending, and every step
        wakes its workers, whose message-queue readers then busy-wait for a second: without
        this an idle prefill or decode keeps two cores busy. Both events arrive in vLLM's input
        queue (a worker's wake-up as a no-op WAKEUP request, see ``_wake_engine_core``), so the
        wait is on that queue's own condition, which ``put`` notifies: nothing polls
        (``vllm_glue.EngineCoreHandle``)."""
        self._rests.rest()

    def _wake_engine_core(self) -> None:
        """Thread-safe: a no-op request that ends ``_rest`` (nothing without an engine core)."""
        self._rests.wake()

    def get_stats(self) -> MooncakeStats | None:
        """The producer's lease figures, reported by vLLM after every step's update (so a lease
        opened by ``request_finished`` is counted before its response leaves)."""
        if self._leases is None:
            return None
        stats = MooncakeStats()
        for reason, n in self._leases.take_ended_counts().items():
            if reason in ("released", "expired", "evicted"):
                stats.count(reason, n)
        stats.count("rejected_frames", sum(self._leases.take_dropped_counts().values()))
        stats.data["held_leases"] = self._leases.held_count
        stats.data["held_bytes"] = self._leases.held_bytes
        return stats

    def shutdown(self) -> None:
        if self._bootstrap is not None:
            self._bootstrap.close()
        if self._leases is not None:
            self._leases.close()
        if self._waker is not None:
            self._waker.close()


@dataclass
class SharedPull:
    """One transfer's pull, as the requests carrying its id see it."""

    puller: str  # the request that pulls
    family: str  # its API request (``vllm_glue.request_family``)
    prompt_digest: str
    state: Literal["pulling", "done", "failed"] = "pulling"

    @classmethod
    def of(cls, puller: Request) -> SharedPull:
        req_id = puller.request_id
        return cls(req_id, request_family(req_id), request_prompt_digest(puller))

    def shared_by(self, request: Request) -> bool:
        """Whether ``request`` is a sibling of the puller (one API request: vLLM's n > 1
        children, a prompt list's repeated prompt; one prompt): it follows this pull. Anything
        else is refused."""
        return (
            request_family(request.request_id) == self.family
            and request_prompt_digest(request) == self.prompt_digest
        )
