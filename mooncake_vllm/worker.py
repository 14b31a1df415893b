"""The worker half: runs in every vLLM worker process and moves the bytes.

Producer: owns the transfer engine registration of the KV cache, the lease table and the side
channel server; ended leases are reported as finished-sending, which frees the blocks.

Consumer: each load is one pull job on a small thread pool, off the forward path:
``Acquire`` (side channel) → plan regions → transfer-engine batch read → ``Release``. The job
never raises; its outcome is collected by ``get_transfer_results`` on the step thread, so no
failure is lost. A failed pull is reported in ``failed_recving`` and vLLM's
``kv_load_failure_policy`` decides. Every pull has a deadline (``load_timeout_s``); reads still in
flight at the deadline get a bounded grace to settle before the blocks are given back, because the
transfer engine cannot cancel and a late write must not land in reused blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from mooncake_vllm.config import ConnectorConfig
from mooncake_vllm.engine import TransferEngine
from mooncake_vllm.leases import LeaseTable
from mooncake_vllm.metadata import P2P_HANDSHAKE
from mooncake_vllm.metadata_bridge import MetadataBridge
from mooncake_vllm.planning import plan_regions, tensor_segments
from mooncake_vllm.protocol import (
    Acquire,
    EngineRecord,
    Granted,
    Handoff,
    MemSegment,
    Refused,
    Release,
    decode_record,
    encode_record,
    registry_key,
)
from mooncake_vllm.scheduler import engine_compat_hash
from mooncake_vllm.side_channel import SideChannelClient, SideChannelServer
from mooncake_vllm.stats import MooncakeStats
from mooncake_vllm.step_metadata import LoadSpec, MooncakeConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 2.0


class PullFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class PullOutcome:
    req_id: str
    ok: bool
    reason: str = ""
    nbytes: int = 0
    blocks: int = 0
    entries: int = 0
    duration_s: float = 0.0
    acquire_s: float = 0.0  # side-channel round trip, producer wait included
    read_s: float = 0.0  # transfer-engine batch read
    refused: bool = False


def _memory_location(t: torch.Tensor) -> str:
    # GPU hosts: tell the engine which device owns the memory. CPU: let it detect.
    return f"cuda:{t.device.index}" if t.device.type == "cuda" else "*"


class WorkerHalf:
    def __init__(self, cfg: ConnectorConfig, vllm_config: VllmConfig, num_blocks: int):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._cfg = cfg
        self._tp_rank = get_tensor_model_parallel_rank()
        self._num_blocks = num_blocks
        self._engine: TransferEngine | None = None
        self._segments: list[MemSegment] = []
        self._bytes_per_block = 0
        self._leases: LeaseTable | None = None
        self._server: SideChannelServer | None = None
        self._client: SideChannelClient | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pulls: dict[str, Future[PullOutcome]] = {}
        self._stats = MooncakeStats()
        self._stats_lock = threading.Lock()
        self._bridge: MetadataBridge | None = None
        self._compat_hash = engine_compat_hash(vllm_config)
        s = cfg.settings
        self._late_grace_s = min(s.load_timeout_s, 10.0)
        if cfg.is_producer:
            self._leases = LeaseTable(
                ttl_s=s.lease_ttl_s,
                budget_bytes=s.kv_buffer_size,
                # A pinned lease outlives the consumer's whole pull, grace included.
                pull_hold_s=s.load_timeout_s + self._late_grace_s + 5.0,
            )
        if cfg.is_consumer:
            self._client = SideChannelClient()
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake-pull")

    # ---- setup ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        segments: list[MemSegment] = []
        storages: dict[int, tuple[int, str]] = {}
        for name in sorted(kv_caches):  # both sides enumerate layers in the same order
            t = kv_caches[name]
            segments += tensor_segments(
                t.data_ptr(), tuple(t.shape), t.stride(), t.element_size(), self._num_blocks
            )
            st = t.untyped_storage()
            storages[st.data_ptr()] = (st.nbytes(), _memory_location(t))
        self._segments = segments
        self._bytes_per_block = sum(s.block_len for s in segments)
        cfg, s = self._cfg, self._cfg.settings
        if self._leases is not None:
            # Bound first: the port doubles as this engine's claim on its name, so a second
            # engine configured with the same address fails here, before it can overwrite our
            # metadata. Acquires only arrive once this engine has handed blocks over.
            self._server = SideChannelServer(
                cfg.host,
                cfg.side_channel_port(self._tp_rank),
                self._leases,
                layout=lambda: (self._engine.segment_name, segments),
            )
        metadata_arg = P2P_HANDSHAKE
        if cfg.metadata.kind != "p2p":
            self._bridge = MetadataBridge(cfg.metadata, ttl_s=s.metadata_ttl_s)
            metadata_arg = self._bridge.url
        try:
            self._engine = TransferEngine(
                cfg.engine_hostname(self._tp_rank),
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
        if self._bridge is not None:
            record = EngineRecord(
                engine_id=cfg.engine_id,
                role=cfg.role,
                tp_rank=self._tp_rank,
                tp_size=cfg.tp_size,
                side_channel=self._server.address if self._server else "",
                te_segment=self._engine.segment_name,
                compat_hash=self._compat_hash,
            )
            self._bridge.publish(registry_key(cfg.engine_id, self._tp_rank), encode_record(record))
        logger.info(
            "MooncakeConnector worker rank %d (%s): %d layers, %d segments, %d B/block, "
            "engine %s, side channel %s, metadata %s",
            self._tp_rank, cfg.role, len(kv_caches), len(segments), self._bytes_per_block,
            self._engine.segment_name, self._server.address if self._server else "-",
            cfg.metadata.describe(),
        )  # fmt: skip

    @property
    def te_segment(self) -> str | None:
        return self._engine.segment_name if self._engine else None

    # ---- every step ----------------------------------------------------------------------

    def start_load_kv(self, meta: MooncakeConnectorMetadata) -> None:
        if self._leases is not None:
            for hold in meta.holds:
                nbytes = len(hold.block_ids) * self._bytes_per_block
                self._leases.add(hold.req_id, hold.transfer_id, hold.block_ids, nbytes)
        for load in meta.loads:
            deadline = time.monotonic() + self._cfg.settings.load_timeout_s
            assert self._pool is not None, "loads are only planned on a consumer"
            self._pulls[load.req_id] = self._pool.submit(self._pull, load, deadline)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self._leases is not None:
            self._leases.expire()
            results.finished_sending = self._leases.take_finished()
        for req_id, fut in list(self._pulls.items()):
            if not fut.done():
                continue
            del self._pulls[req_id]
            outcome = fut.result()  # _pull never raises
            if outcome.reason == "release-only":
                continue  # vLLM did not wait on this request
            results.finished_recving.add(req_id)
            with self._stats_lock:
                if outcome.ok:
                    self._stats.record_pull(
                        outcome.nbytes,
                        outcome.blocks,
                        outcome.entries,
                        outcome.duration_s,
                        acquire_s=outcome.acquire_s,
                        read_s=outcome.read_s,
                    )
                else:
                    logger.warning("request %s: KV pull failed: %s", req_id, outcome.reason)
                    results.failed_recving.add(req_id)
                    self._stats.count("pull_failures")
                    if outcome.refused:
                        self._stats.count("refused")
        return results

    def get_stats(self) -> MooncakeStats | None:
        with self._stats_lock:
            if self._leases is not None:
                ended = self._leases.ended_counts
                for key in ("released", "expired", "evicted"):
                    self._stats.count(key, ended.pop(key, 0))
                self._stats.data["held_leases"] = {str(self._tp_rank): self._leases.held_count}
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, MooncakeStats()
            return out

    # ---- the pull ------------------------------------------------------------------------

    def _pull(self, load: LoadSpec, deadline: float) -> PullOutcome:
        start = time.monotonic()
        h = load.handoff
        address = None
        if not load.local_block_ids:  # vLLM does not wait on this one: just free the lease
            if h is not None:
                try:
                    self._release(self._producer_address(h), h.transfer_id, load.error is None)
                except Exception as e:  # the producer's lease TTL frees the blocks anyway
                    logger.warning("release of %s failed: %s", h.transfer_id, e)
            return PullOutcome(load.req_id, ok=True, reason="release-only")
        acquired = succeeded = False
        try:
            if load.error is not None:
                raise PullFailed(load.error)
            assert h is not None and self._engine is not None
            address = self._producer_address(h)
            reply = self._client.call(
                address,
                Acquire(h.transfer_id, self._cfg.engine_id, load.remote_block_ids),
                timeout_s=max(0.1, deadline - time.monotonic()),
            )
            if isinstance(reply, Refused):
                return PullOutcome(load.req_id, ok=False, reason=reply.reason, refused=True)
            if not isinstance(reply, Granted):
                raise PullFailed(f"unexpected reply {type(reply).__name__}")
            acquired = True
            acquired_at = time.monotonic()
            regions = plan_regions(
                reply.segments, self._segments, load.remote_block_ids, load.local_block_ids
            )
            read = self._engine.read(
                reply.te_segment,
                regions,
                self._cfg.settings.max_batch_entries,
                deadline=deadline,
                settle_deadline=deadline + self._late_grace_s,
            )
            succeeded = True
            logger.debug(
                "request %s: pulled %d blocks (%d B, %d entries) from %s: acquire %.1f ms, "
                "read %.1f ms", load.req_id, len(load.local_block_ids), read.bytes, read.entries,
                reply.te_segment, 1000 * (acquired_at - start), 1000 * read.duration_s,
            )  # fmt: skip
            return PullOutcome(
                load.req_id,
                ok=True,
                nbytes=read.bytes,
                blocks=len(load.local_block_ids),
                entries=read.entries,
                duration_s=time.monotonic() - start,
                acquire_s=acquired_at - start,
                read_s=read.duration_s,
            )
        except Exception as e:
            return PullOutcome(load.req_id, ok=False, reason=f"{type(e).__name__}: {e}")
        finally:
            if acquired and h is not None and address is not None:
                self._release(address, h.transfer_id, ok=succeeded)

    def _producer_address(self, h: Handoff) -> str:
        """The side channel of the producer rank this worker pulls from: named in the handoff,
        or looked up by the producer's engine id in the engine registry."""
        if h.side_channel_ports:
            return f"{h.side_channel_host}:{h.side_channel_ports[self._tp_rank]}"
        if self._bridge is None:
            raise PullFailed(
                f"the handoff names no side channel for producer {h.producer_engine_id!r} and "
                "no metadata store is configured to look it up (metadata_server is P2PHANDSHAKE)"
            )
        data = self._bridge.lookup(registry_key(h.producer_engine_id, self._tp_rank))
        if data is None:
            raise PullFailed(f"producer engine {h.producer_engine_id!r} is not in the registry")
        record = decode_record(data)
        if not record.side_channel:
            raise PullFailed(f"engine {h.producer_engine_id!r} is a {record.role}, not a producer")
        if record.compat_hash != h.compat_hash:
            raise PullFailed(f"registry compat hash of {h.producer_engine_id!r} differs")
        return record.side_channel

    def _release(self, address: str, transfer_id: str, ok: bool) -> None:
        try:
            self._client.call(address, Release(transfer_id, ok), timeout_s=_RELEASE_TIMEOUT_S)
        except Exception as e:  # the producer's lease TTL frees the blocks anyway
            logger.warning("release of %s at %s failed: %s", transfer_id, address, e)

    # ---- teardown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._server is not None:
            self._server.close()
        if self._client is not None:
            self._client.close()
        if self._engine is not None:
            self._engine.close()
        if self._bridge is not None:
            self._bridge.close()  # after the engine: its teardown removes keys through the bridge
