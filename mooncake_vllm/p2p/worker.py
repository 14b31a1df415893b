"""The worker half: runs in every vLLM worker process and moves the bytes.

Producer: registers the KV cache with the transfer engine and hands its layout to the scheduler
half (vLLM's handshake metadata), whose side channel serves the leases (``leases.client``); reports
the requests whose leases ended as finished-sending, which frees the blocks.

Consumer: each load is one pull job of its ``Puller`` (``puller``), off the forward path; its
outcome is collected by ``get_transfer_results`` on the step thread, so no failure is lost, and
a failed pull is reported in ``failed_recving`` for vLLM's ``kv_load_failure_policy``. When a
pull ends the worker wakes the scheduler half (``local_channels``), which lets vLLM rest while
nothing else is to be done.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from mooncake_vllm.core.auth import seal_record
from mooncake_vllm.core.kv_groups import KVGroup, group_segments
from mooncake_vllm.core.loads import MooncakeWorkerMeta
from mooncake_vllm.core.planning import (
    REBLOCKABLE,
    kv_cache_regions,
    rank_heads,
)
from mooncake_vllm.core.registry import (
    EngineRecord,
    ServingRecord,
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
    MemSegment,
)
from mooncake_vllm.p2p.puller import Puller
from mooncake_vllm.p2p.side_channel import SideChannelError
from mooncake_vllm.p2p.stats import MooncakeStats
from mooncake_vllm.p2p.step_metadata import MooncakeConnectorMetadata
from mooncake_vllm.transfer.engine import TransferAgent
from mooncake_vllm.transfer.store_bridge import KeyScope, MetadataBridge

logger = logging.getLogger(__name__)


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
        self._groups = kv_groups
        self._group_segments: list[list[int]] = []  # per group: its layers' segment indices
        self._rank = cfg.rank(tp_rank, pp_rank)
        self._owners: list[str] = []  # each segment's layer
        self._heads = rank_heads(kv_heads, cfg.tp_size, tp_rank)
        self._block_size = block_size
        self._kv_format = kv_format
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
        self._wake: WakeSender | None = None
        self._stats = WorkerStats(MooncakeStats)
        self._bridge: MetadataBridge | None = None
        self._compat_hash = compat_hash
        self._keys = cfg.settings.auth_keys()  # read once: a rotated secret needs a restart
        # A consumer's pulls (``puller``); None on a producer.
        self._puller: Puller | None = None
        if cfg.is_consumer:
            self._puller = Puller(
                cfg,
                tp_rank,
                self._rank,
                self._keys,
                self._wake_scheduler,
                kv_replicated=kv_replicated,
                kv_heads=kv_heads,
                block_size=block_size,
                kv_groups=kv_groups,
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
        if cfg.is_producer and s.layerwise_handoff:
            self._open_marks(kv_caches, segments)
        if self._puller is not None:
            layers = [kv_caches[name] for name in sorted(kv_caches)]
            staging = None
            if (
                self._kv_format == REBLOCKABLE
                and s.reblock_buffer_bytes
                and len(layers) == len(segments)
            ):
                staging = torch.empty(s.reblock_buffer_bytes, dtype=torch.uint8)
                self._engine.register(staging.data_ptr(), s.reblock_buffer_bytes, "*")
            self._puller.reader.attach(
                self._engine, segments, owners, self._group_segments, layers, staging
            )
            self._puller.use_registry(self._bridge)
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
        if self._puller is None:
            assert not meta.loads, "loads are only planned on a consumer"
            return
        for load in meta.loads:
            self._puller.submit(load)
        for req_id in meta.cancelled:  # after the loads: one may end in the step it began
            self._puller.cancel(req_id)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        results.finished_sending, self._finished_sending = self._finished_sending, set()
        outcomes = self._puller.collect() if self._puller is not None else []
        for outcome in outcomes:  # a pull never raises
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
        return self._puller.worker_meta() if self._puller is not None else None

    def get_stats(self) -> MooncakeStats | None:
        if self._puller is not None:
            with self._stats.update() as stats:
                stats.count("rejected_frames", self._puller.take_rejected())
        return self._stats.take()

    # ---- teardown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._puller is not None:
            self._puller.shutdown()
        if self._claim is not None:
            self._claim.close()
        if self._marks_out is not None:
            self._marks_out.close()
        if self._wake is not None:
            self._wake.close()
            self._wake = None
        if self._engine is not None:
            self._engine.close()
        if self._bridge is not None:
            self._bridge.close()  # after the engine: its teardown removes keys through the bridge
