"""The Prometheus side both connectors share: series per engine on vLLM's own ``/metrics``,
filled from a stats dict (counters add, histograms observe each sample, gauges keep the newest)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics


class ConnectorPromMetrics(KVConnectorPromMetrics):
    """Subclasses fill ``_counters``, ``_histograms`` and ``_gauges`` (stats key → per-engine
    series) with ``per_engine``; ``observe`` is the same for all."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labelnames, self._labelvalues = labelnames, per_engine_labelvalues
        self._counters: dict[str, dict[int, Any]] = {}
        self._histograms: dict[str, dict[int, Any]] = {}
        self._gauges: dict[str, dict[int, Any]] = {}

    def per_engine(self, cls, name: str, doc: str, **kw) -> dict[int, Any]:
        metric = cls(name=name, documentation=doc, labelnames=self._labelnames, **kw)
        return {i: metric.labels(*v) for i, v in self._labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metrics in self._counters.items():
            if transfer_stats_data.get(key):
                metrics[engine_idx].inc(transfer_stats_data[key])
        for key, metrics in self._histograms.items():
            for value in transfer_stats_data.get(key, ()):
                metrics[engine_idx].observe(value)
        for key, metrics in self._gauges.items():
            if (value := transfer_stats_data.get(key)) is not None:
                metrics[engine_idx].set(value)
