"""What both connector classes are: a thin facade that vLLM builds twice per engine, over a
scheduler half (role SCHEDULER, in the engine-core process) and a worker half (role WORKER, in
every worker process). The halves share no memory; they speak through the per-step connector
metadata (scheduler → workers) and the workers' ``MooncakeWorkerMeta`` (workers → scheduler).

``HalvesConnector`` does the startup both connectors share (refuse sleep mode, vLLM logging, then
``_prepare_process`` once the settings are valid) and forwards every hook whose meaning is the same
for both; each connector names its metadata and stats classes, builds its halves in
``_build_halves`` and adds what is its own (saving, the P2P handshake).

A half provides: scheduler half ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``request_finished(request, block_ids)``, ``bind_block_pool``,
``update_connector_output``, ``has_pending_work``, ``get_stats``, ``shutdown``; worker half
``register_kv_caches``, ``get_transfer_results``, ``build_worker_meta``, ``get_stats``,
``shutdown``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from mooncake_vllm.core import os_threads
from mooncake_vllm.core.loads import MooncakeWorkerMeta
from mooncake_vllm.core.prom import ConnectorPromMetrics
from mooncake_vllm.core.sleep_mode import refuse_sleep_mode, sleep_mode_refusal
from mooncake_vllm.plugin import use_vllm_logging
from mooncake_vllm.vllm_glue import (
    Probe,
    check_vllm,
    one_engine_core_signal_at_a_time,
    shorten_queue_spin,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from mooncake_vllm.core.settings import SharedSettings

logger = logging.getLogger(__name__)


class HalvesConnector(KVConnectorBase_V1):
    _scheduler: Any = None  # set by the subclass for role SCHEDULER
    _worker: Any = None  # set by the subclass for role WORKER
    # What each connector names: the scheduler → workers metadata its worker half takes, and
    # the stats classes vLLM builds in its logging process.
    metadata_type: type[KVConnectorMetadata]
    stats_type: type[KVConnectorStats]
    prom_metrics_type: type[ConnectorPromMetrics]

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        refuse_sleep_mode(vllm_config, type(self).__name__)  # before anything is registered
        use_vllm_logging()  # also when loaded by kv_connector_module_path, without the plugin
        self._build_halves(vllm_config, kv_cache_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks this before it builds anything (``--enable-sleep-mode`` then stops the
        engine with "<name> does not support sleep mode."); ``refuse_sleep_mode`` says why."""
        return False

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33 calls this before sleep mode frees the KV cache; never reached, since
        ``supports_sleep_mode`` and ``refuse_sleep_mode`` stop such an engine at startup."""
        raise RuntimeError(sleep_mode_refusal(type(self).__name__))

    def restore_kv_caches(self) -> None:
        """vLLM 0.33 calls this after a wake-up (see ``unregister_kv_caches``)."""
        raise RuntimeError(sleep_mode_refusal(type(self).__name__))

    def _build_halves(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None):
        """Load and validate the connector's settings (so a bad config stops vLLM at startup),
        call ``_prepare_process``, then set ``_scheduler`` (role SCHEDULER) or ``_worker``."""
        raise NotImplementedError

    def _prepare_process(self, settings: SharedSettings) -> Probe:
        """Once the settings are valid, in both roles: check vLLM's internals (raises unless
        ``allow_untested_vllm``), set the threads' OS policy, shorten vLLM's queue spin; in the
        engine core, keep vLLM's signal handler from running inside itself (a group signal's
        drain)."""
        probe = check_vllm(settings.allow_untested_vllm)
        os_threads.set_policy(settings.thread_priority)
        shorten_queue_spin(settings.vllm_busy_loop_s)
        if self.role == KVConnectorRole.SCHEDULER:
            one_engine_core_signal_at_a_time()
        return probe

    # ---- worker side ---------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, self.metadata_type)
        self._worker.start_load_kv(meta)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def build_connector_worker_meta(self) -> MooncakeWorkerMeta | None:
        return self._worker.build_worker_meta()

    def get_kv_connector_stats(self) -> Any:
        half = self._worker if self._worker is not None else self._scheduler
        return half.get_stats() if half is not None else None

    def shutdown(self) -> None:
        for half in (self._worker, self._scheduler):
            if half is not None:
                half.shutdown()

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
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
        # vLLM calls this inside its scheduler's step, with no handler around it: an exception
        # would end the engine core and every request on it. Nothing handed over, the blocks
        # freed now, is the answer that loses nothing but this request's handoff.
        try:
            return self._scheduler.request_finished(request, block_ids)
        except Exception:
            logger.exception("request %s: not handed over, connector error", request.request_id)
            return False, None

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._scheduler.bind_block_pool(gpu_block_pool)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        # vLLM's only hook that keeps its loop stepping without requests (named for push
        # connectors); ours: destination blocks still pinned under a load that outlived its
        # request.
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # ---- stats (class-level hooks vLLM calls in its logging process) ---------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return cls.stats_type(data=data) if data is not None else cls.stats_type()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return cls.prom_metrics_type(vllm_config, metric_types, labelnames, per_engine_labelvalues)
