"""Pool figures through vLLM's connector-stats hooks (logged with its stats line, and exposed as
``mooncake_vllm:pool_*`` on vLLM's ``/metrics``).

Scheduler half: lookups (hit/miss blocks). Worker half: puts and gets (blocks, bytes, durations,
failures). vLLM aggregates both halves and all workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_vllm.core.prom import ConnectorPromMetrics, KeyedStats

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


@dataclass
class PoolStats(KeyedStats):
    COUNTER_KEYS = tuple(COUNTERS)
    SAMPLE_KEYS = tuple(SAMPLES)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in COUNTERS if d.get(k)}
        for key in SAMPLES:
            if d.get(key):
                out[f"avg_{key.removesuffix('_durations_s')}_ms"] = round(
                    1000 * sum(d[key]) / len(d[key]), 3
                )
        return out


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
