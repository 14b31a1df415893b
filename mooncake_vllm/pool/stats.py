"""Pool figures through vLLM's connector-stats hooks (logged with its stats line, and exposed as
``mooncake_vllm:pool_*`` on vLLM's ``/metrics``).

Scheduler half: lookups (hit/miss blocks). Worker half: puts and gets (blocks, bytes, durations,
failures). vLLM aggregates both halves and all workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from mooncake_vllm.core.prom import ConnectorPromMetrics

COUNTERS = {
    "lookups": "existence checks of a prompt's blocks (scheduler)",
    "lookup_failures": "existence checks that failed or timed out (counted as misses)",
    "hit_blocks": "blocks found in the pool beyond the local prefix cache",
    "miss_blocks": "blocks looked up and not found (computed locally)",
    "put_blocks": "blocks put into the pool",
    "put_bytes": "bytes put into the pool",
    "put_skipped_blocks": "blocks not put because the pool already held them",
    "put_failures": "blocks whose put failed (pool full, master away): logged, request unharmed",
    "loads": "loads from the pool that completed",
    "get_blocks": "blocks read from the pool",
    "get_bytes": "bytes read from the pool",
    "get_retries": "gets asked again after a repeatable failure (lease expired, transfer failed)",
    "load_failures": "loads that failed or timed out (then vLLM's kv_load_failure_policy)",
}
SAMPLES = {
    "put_durations_s": ("pool_put_duration_seconds", "Wall time of one step's puts"),
    "get_durations_s": ("pool_get_duration_seconds", "Wall time of one load from the pool"),
}


def _empty() -> dict[str, Any]:
    return {**dict.fromkeys(COUNTERS, 0), **{k: [] for k in SAMPLES}}


@dataclass
class PoolStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=_empty)

    def count(self, key: str, n: int = 1) -> None:
        self.data[key] += n

    def sample(self, key: str, value: float) -> None:
        self.data[key].append(value)

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> PoolStats:
        for key in COUNTERS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        for key in SAMPLES:
            self.data[key] = self.data.get(key, []) + list(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in COUNTERS if d.get(k)}
        for key in SAMPLES:
            if d.get(key):
                out[f"avg_{key.removesuffix('_durations_s')}_ms"] = round(
                    1000 * sum(d[key]) / len(d[key]), 3
                )
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in (*COUNTERS, *SAMPLES))


class PoolPromMetrics(ConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per_engine = self.per_engine

        self._counters = {
            key: per_engine(self._counter_cls, f"mooncake_vllm:pool_{key}", doc)
            for key, doc in COUNTERS.items()
        }
        buckets = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10]
        self._histograms = {
            key: per_engine(self._histogram_cls, f"mooncake_vllm:{name}", doc, buckets=buckets)
            for key, (name, doc) in SAMPLES.items()
        }
