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

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from mooncake_vllm.core import os_threads
from mooncake_vllm.core.cpu_mla import warn_cpu_mla_rope
from mooncake_vllm.core.identity import engine_compat_hash
from mooncake_vllm.core.model_identity import engine_model_identity
from mooncake_vllm.core.settings import check_role, load_settings
from mooncake_vllm.core.sleep_mode import refuse_sleep_mode
from mooncake_vllm.plugin import use_vllm_logging
from mooncake_vllm.pool.config import PoolSettings, check_reachable
from mooncake_vllm.pool.scheduler import PoolSchedulerHalf
from mooncake_vllm.pool.stats import PoolPromMetrics, PoolStats
from mooncake_vllm.pool.step_metadata import PoolConnectorMetadata
from mooncake_vllm.vllm_glue import check_vllm, shorten_queue_spin

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from mooncake_vllm.pool.worker import PoolWorkerHalf


class MooncakeStoreConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        refuse_sleep_mode(vllm_config, "MooncakeStoreConnector")  # before anything is registered
        use_vllm_logging()
        ktc = vllm_config.kv_transfer_config
        settings: PoolSettings = load_settings(ktc.kv_connector_extra_config, model=PoolSettings)
        check_role(ktc.kv_role, "MooncakeStoreConnector")
        check_reachable(settings)
        check_vllm(settings.allow_untested_vllm)
        os_threads.set_policy(settings.thread_priority)
        shorten_queue_spin(settings.vllm_busy_loop_s)
        is_producer = ktc.kv_role in ("kv_producer", "kv_both")
        is_consumer = ktc.kv_role in ("kv_consumer", "kv_both")
        self._scheduler: PoolSchedulerHalf | None = None
        self._worker: PoolWorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
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
            )

    # ---- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # whole blocks are put in wait_for_save, after the forward pass

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta()

    def get_kv_connector_stats(self) -> PoolStats | None:
        half = self._worker if self._worker is not None else self._scheduler
        return half.get_stats() if half is not None else None

    def shutdown(self) -> None:
        for half in (self._worker, self._scheduler):
            if half is not None:
                half.shutdown()

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._scheduler.bind_block_pool(gpu_block_pool)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        # Keeps vLLM stepping while a load's blocks are pinned past its request (see scheduler).
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # ---- stats (class-level hooks vLLM calls in its logging process) ---------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PoolStats:
        return PoolStats(data=data) if data is not None else PoolStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
