"""``MooncakeConnector``: the class vLLM instantiates, a thin facade over the two halves.

vLLM builds it twice per engine: with role SCHEDULER in the engine-core process (→
``SchedulerHalf``) and with role WORKER in every worker process (→ ``WorkerHalf``). The halves
share no memory; they speak only through the per-step ``MooncakeConnectorMetadata`` (scheduler →
workers) and ``MooncakeWorkerMeta`` (workers → scheduler). The config is loaded and validated in
both, at construction, so a bad config stops vLLM at startup.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from mooncake_vllm import vllm_glue
from mooncake_vllm.core.cpu_mla import warn_cpu_mla_rope
from mooncake_vllm.core.facade import HalvesConnector
from mooncake_vllm.core.identity import (
    engine_compat_hash,
    engine_kv_heads,
    engine_kv_layout,
    kv_is_replicated,
)
from mooncake_vllm.core.kv_groups import GroupError, KVGroup, kv_groups
from mooncake_vllm.core.model_identity import engine_model_identity
from mooncake_vllm.p2p.config import load_settings, resolve
from mooncake_vllm.p2p.leases.client import RankLayout
from mooncake_vllm.p2p.protocol import MemSegment
from mooncake_vllm.p2p.scheduler import SchedulerHalf
from mooncake_vllm.p2p.stats import MooncakePromMetrics, MooncakeStats
from mooncake_vllm.p2p.step_metadata import MooncakeConnectorMetadata
from mooncake_vllm.vllm_glue import shorten_gil_switch_interval

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MooncakeHandshake(KVConnectorHandshakeMetadata):
    """Worker → scheduler at startup: the rank's transfer-engine segment name and KV layout,
    which the producer's side channel (in the scheduler's process) hands to consumers."""

    te_segment: str
    segments: list[MemSegment]
    worker_pid: int
    layers: list[str]  # each segment's layer: a pipeline stage holds its own


def check_layerwise(vllm_config: VllmConfig) -> None:
    """``layerwise_handoff`` marks a layer written when vLLM calls ``save_kv_layer``: true on
    CPU, where the cache update runs before it on the same thread and the scheduler waits for
    each step's output before the next (no step can free a finishing request's blocks)."""
    from mooncake_vllm.core.settings import ConfigError

    device = vllm_config.device_config.device_type
    if device != "cpu" or vllm_config.scheduler_config.async_scheduling:
        raise ConfigError(
            f"layerwise_handoff=true is built for vLLM's CPU backend without async scheduling "
            f"(this engine: device {device!r}, async_scheduling "
            f"{vllm_config.scheduler_config.async_scheduling}); set layerwise_handoff to false"
        )


def check_pipeline_parallel(vllm_config: VllmConfig, layerwise: bool) -> int:
    """The engine's pipeline stages. Each stage's workers have ports of their own (worker rank
    ``pp_rank * tp_size + tp_rank``); a producer's handoffs and ``/query`` name every rank, and
    a grant names the layers its stage holds, so each stage of a consumer, of any PP size,
    reads each of its layers from the producer stage that has it. ``layerwise_handoff`` (its
    marks are by segment order of one stage) stops vLLM at startup, naming the flag."""
    from mooncake_vllm.core.settings import ConfigError

    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1 and layerwise:
        raise ConfigError(
            f"--pipeline-parallel-size {pp}: layerwise_handoff marks the layers of one "
            "pipeline stage; set layerwise_handoff to false"
        )
    return pp


def engine_kv_groups(kv_cache_config: KVCacheConfig | None, layerwise: bool):
    """The engine's KV cache groups (``core.kv_groups``); a model whose groups cannot be moved,
    or ``layerwise_handoff`` with more than one, stops vLLM at startup naming why."""
    from mooncake_vllm.core.settings import ConfigError

    try:
        groups = kv_groups(kv_cache_config)
    except GroupError as e:
        raise ConfigError(f"{e}; this model cannot be served through MooncakeConnector") from e
    if layerwise and (len(groups) > 1 or groups[0].sliding_window):
        raise ConfigError(
            "layerwise_handoff=true marks whole layers of one full-attention KV cache group; "
            f"this model has {len(groups)} ({', '.join(g.describe() for g in groups)}): set "
            "layerwise_handoff to false"
        )
    return groups


class MooncakeConnector(HalvesConnector, SupportsHMA):
    """``SupportsHMA``: vLLM keeps its hybrid memory allocator on for us, so a model that mixes
    sliding-window and full attention gets a KV cache group per kind (a sliding group holds the
    window only) and its handoff names every group's blocks (``core.kv_groups``)."""

    metadata_type = MooncakeConnectorMetadata
    stats_type = MooncakeStats
    prom_metrics_type = MooncakePromMetrics

    def _build_halves(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None):
        ktc = vllm_config.kv_transfer_config
        settings = load_settings(ktc.kv_connector_extra_config)
        pp_size = check_pipeline_parallel(vllm_config, settings.layerwise_handoff)
        probe = self._prepare_process(settings)
        parallel = vllm_config.parallel_config
        self._cfg = resolve(
            settings,
            ktc.kv_role,
            ktc.engine_id or "mooncake",
            parallel.tensor_parallel_size,
            **vllm_glue.data_parallel_ranks(parallel),
            pp_size=pp_size,
        )
        observability = getattr(vllm_config, "observability_config", None)
        endpoint = getattr(observability, "otlp_traces_endpoint", None)
        if endpoint:
            self._cfg = dataclasses.replace(self._cfg, otlp_traces_endpoint=endpoint)
        self._scheduler: SchedulerHalf | None = None
        self._worker = None
        layerwise = settings.layerwise_handoff and self._cfg.is_producer
        if layerwise:
            check_layerwise(vllm_config)
        groups: tuple[KVGroup, ...] = engine_kv_groups(kv_cache_config, layerwise)
        model_identity = engine_model_identity(vllm_config, settings.model_identity)
        # Any TP size and block size on either side: the consumer re-lays the KV out.
        compat = engine_compat_hash(vllm_config, model_identity, any_layout=True)
        replicated = kv_is_replicated(vllm_config)
        kv_heads = engine_kv_heads(vllm_config)
        kv_format = vllm_glue.kv_format(vllm_config)
        if self.role == KVConnectorRole.SCHEDULER:
            warn_cpu_mla_rope(vllm_config)  # once per engine: the scheduler half is one
            self._scheduler = SchedulerHalf(
                self._cfg,
                vllm_config.cache_config.block_size,
                compat,
                kv_layout=engine_kv_layout(vllm_config, model_identity),
                kv_replicated=replicated,
                kv_heads=kv_heads,
                kv_format=kv_format,
                probe=probe,
                kv_groups=groups,
            )
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            from mooncake_vllm.p2p.worker import WorkerHalf  # needs torch; workers only

            shorten_gil_switch_interval(settings.gil_switch_interval_s)
            if self._cfg.is_producer:
                # Leases granted before a group SIGTERM are served while the engine drains.
                vllm_glue.outlive_group_signal()
            assert kv_cache_config is not None
            self._worker = WorkerHalf(
                self._cfg,
                get_tensor_model_parallel_rank(),
                compat,
                kv_cache_config.num_blocks,
                kv_replicated=replicated,
                kv_heads=kv_heads,
                block_size=vllm_config.cache_config.block_size,
                kv_format=kv_format,
                kv_groups=groups,
                pp_rank=get_pp_group().rank_in_group,
            )

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid allocator on (every model then, one group or more): as
        ``request_finished``, guarded the same way, with every group's blocks."""
        try:
            return self._scheduler.request_finished(request, block_ids[0], block_ids[1:])
        except Exception:
            logger.exception("request %s: not handed over, connector error", request.request_id)
            return False, None

    # ---- worker side ---------------------------------------------------------------------

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        # Pull design: the producer saves nothing, consumers read its blocks; with
        # layerwise_handoff it says which layers are written.
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, MooncakeConnectorMetadata)
            self._worker.save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        return

    def get_handshake_metadata(self) -> MooncakeHandshake | None:
        # The engine core asks right after it built its scheduler: it has started.
        vllm_glue.arm_group_signal_hold()
        if self._worker is None or self._worker.te_segment is None:
            return None
        return MooncakeHandshake(
            self._worker.te_segment, self._worker.segments, os.getpid(), self._worker.layers
        )

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Every worker's layout, by worker rank (one pipeline stage: the TP rank)."""
        layouts = {
            rank: RankLayout(m.te_segment, list(m.segments), m.worker_pid, list(m.layers))
            for rank, m in metadata.items()
            if isinstance(m, MooncakeHandshake)
        }
        if self._scheduler is not None:
            self._scheduler.set_layouts(layouts)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """vLLM's hook, keyed by ``(pp_rank, tp_rank)``: each stage's workers by worker rank."""
        tp = self._cfg.tp_size
        self.set_xfer_handshake_metadata({pp * tp + t: m for (pp, t), m in metadata.items()})
