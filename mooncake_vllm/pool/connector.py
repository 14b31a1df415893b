"""``MooncakeStoreConnector``: the class vLLM instantiates for pool mode, a thin facade.

As for ``MooncakeConnector``, vLLM builds it with role SCHEDULER in the engine-core process (→
``PoolSchedulerHalf``) and with role WORKER in every worker process (→ ``PoolWorkerHalf``); the
halves speak only through ``PoolConnectorMetadata`` (scheduler → workers) and the settled loads
in ``MooncakeWorkerMeta`` (workers → scheduler). Settings are validated and mooncake_master is
probed in both, at construction, so a bad config or an absent master stops vLLM at startup.

Roles: ``kv_producer`` only puts, ``kv_consumer`` only gets, ``kv_both`` (a pool's usual role)
does both. No ``kv_transfer_params`` are needed or returned: any proxy works.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    SupportsHMA,
)

from mooncake_vllm.core.cpu_mla import warn_cpu_mla_rope
from mooncake_vllm.core.facade import HalvesConnector
from mooncake_vllm.core.identity import engine_compat_hash
from mooncake_vllm.core.kv_groups import GroupError, KVGroup, kv_groups
from mooncake_vllm.core.model_identity import engine_model_identity
from mooncake_vllm.core.settings import ConfigError, check_role, load_settings
from mooncake_vllm.p2p.local_channels import pool_wake_endpoint
from mooncake_vllm.pool.config import PoolSettings, check_reachable
from mooncake_vllm.pool.scheduler import PoolSchedulerHalf
from mooncake_vllm.pool.stats import PoolPromMetrics, PoolStats
from mooncake_vllm.pool.step_metadata import PoolConnectorMetadata
from mooncake_vllm.vllm_glue import EngineCoreHandle

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from mooncake_vllm.pool.worker import PoolWorkerHalf

logger = logging.getLogger(__name__)


def pool_kv_groups(kv_cache_config: KVCacheConfig | None) -> tuple[KVGroup, ...]:
    """The engine's KV cache groups; one we cannot store stops vLLM at startup naming it."""
    try:
        return kv_groups(kv_cache_config)
    except GroupError as e:
        raise ConfigError(f"{e}; this model cannot be served through MooncakeStoreConnector") from e


def refuse_pipeline_parallel(vllm_config: VllmConfig) -> None:
    """A pool block's value is every layer of the engine (its key names the TP rank only): a
    pipeline stage holds half of them, and two stages would put different values under one key.
    Stops vLLM at startup naming the flag (the P2P connector serves pipeline parallel)."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        raise ConfigError(
            f"--pipeline-parallel-size {pp}: MooncakeStoreConnector keys a block's KV of every "
            "layer by TP rank, not by pipeline stage; serve pool engines with "
            "--pipeline-parallel-size 1 (MooncakeConnector, P2P, serves pipeline parallel)"
        )


class MooncakeStoreConnector(HalvesConnector, SupportsHMA):
    """``SupportsHMA``: vLLM keeps its hybrid memory allocator on, so a sliding-window model's
    groups keep (and the pool stores and loads) a window's blocks (``pool.keys``)."""

    metadata_type = PoolConnectorMetadata
    stats_type = PoolStats
    prom_metrics_type = PoolPromMetrics

    def _build_halves(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None):
        ktc = vllm_config.kv_transfer_config
        settings: PoolSettings = load_settings(ktc.kv_connector_extra_config, model=PoolSettings)
        check_role(ktc.kv_role, "MooncakeStoreConnector")
        refuse_pipeline_parallel(vllm_config)
        check_reachable(settings)
        probe = self._prepare_process(settings)
        # Where the workers tell the scheduler half a load ended.
        wake = pool_wake_endpoint(ktc.engine_id, vllm_config.parallel_config.data_parallel_rank)
        is_producer = ktc.kv_role in ("kv_producer", "kv_both")
        is_consumer = ktc.kv_role in ("kv_consumer", "kv_both")
        groups = pool_kv_groups(kv_cache_config)
        self._scheduler: PoolSchedulerHalf | None = None
        self._worker: PoolWorkerHalf | None = None
        if self.role == KVConnectorRole.SCHEDULER:
            warn_cpu_mla_rope(vllm_config)  # once per engine: the scheduler half is one
            store = None
            if is_consumer:
                from mooncake_vllm.pool.store import PoolStore

                store = PoolStore(settings, 0, 0)  # lookups only: mounts nothing
            self._scheduler = PoolSchedulerHalf(
                settings,
                is_producer=is_producer,
                is_consumer=is_consumer,
                block_size=vllm_config.cache_config.block_size,
                # Keys of another model's KV (even of the same shape) never match.
                salt=engine_compat_hash(
                    vllm_config, engine_model_identity(vllm_config, settings.model_identity)
                ),
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                store=store,
                kv_replicated=vllm_config.model_config.use_mla,
                engine_core=EngineCoreHandle.find(probe),
                wake_endpoint=wake,
                kv_groups=groups,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from mooncake_vllm.pool.worker import PoolWorkerHalf  # needs torch; workers only

            assert kv_cache_config is not None
            self._worker = PoolWorkerHalf(
                settings,
                is_producer=is_producer,
                is_consumer=is_consumer,
                tp_rank=get_tensor_model_parallel_rank(),
                num_blocks=kv_cache_config.num_blocks,
                kv_replicated=vllm_config.model_config.use_mla,
                wake_endpoint=wake,
                kv_groups=groups,
            )

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid allocator on: as ``request_finished``, guarded the same
        way (nothing is held for the pool)."""
        try:
            return self._scheduler.request_finished(request, block_ids[0])
        except Exception:
            logger.exception("request %s: pool connector error at its end", request.request_id)
            return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        """vLLM's scheduler reads this once, at startup: True makes it drop a preempted
        request's in-flight output and recompute it, so that a handoff does not go out from
        blocks the preemption freed. The default is the producer role, True for ``kv_both``;
        the pool hands nothing off when a request ends (its saves end within the step that
        computed them) and is a best-effort cache, where a lost save is a later miss. False, as
        vLLM's own ``OffloadingConnector`` answers."""
        return False

    # ---- worker side ---------------------------------------------------------------------

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # whole blocks are put in wait_for_save, after the forward pass

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()
