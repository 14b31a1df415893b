"""Transfer statistics through vLLM's connector-stats hooks.

Workers fill a ``MooncakeStats`` per step with their pulls, the scheduler half with the producer's
leases (both through ``get_kv_connector_stats``); vLLM aggregates them across workers, halves and
intervals, logs ``reduce()`` with its periodic stats line, and hands the raw
data to ``MooncakePromMetrics.observe`` for its Prometheus ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_vllm.core.prom import ConnectorPromMetrics, KeyedStats

_COUNTERS = (
    "pulls",
    "pull_failures",
    "bytes",
    "blocks",
    "entries",
    "released",
    "expired",
    "evicted",
    "refused",
    "cancelled",
    "retries",
    "stalls",
    "layered",
    "rejected_frames",
    "acquire_s",
    "read_s",
)
# Per-pull samples, one list each, observed into the histograms below.
_SAMPLES = ("durations_s", "acquires_s", "reads_s")
# Point-in-time producer figures (None: not reported): aggregation keeps the newest value.
_GAUGES = ("held_leases", "held_bytes")


@dataclass
class MooncakeStats(KeyedStats):
    COUNTER_KEYS = _COUNTERS
    SAMPLE_KEYS = _SAMPLES
    GAUGE_KEYS = _GAUGES

    def record_pull(
        self,
        nbytes: int,
        blocks: int,
        entries: int,
        duration_s: float,
        acquire_s: float = 0.0,
        read_s: float = 0.0,
    ) -> None:
        self.data["pulls"] += 1
        self.data["acquire_s"] += acquire_s
        self.data["read_s"] += read_s
        self.data["bytes"] += nbytes
        self.data["blocks"] += blocks
        self.data["entries"] += entries
        self.data["durations_s"].append(duration_s)
        self.data["acquires_s"].append(acquire_s)
        self.data["reads_s"].append(read_s)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        total_s = sum(d["durations_s"])
        out: dict[str, int | float] = {
            k: d[k] for k in _COUNTERS if d[k] and k not in ("acquire_s", "read_s")
        }
        if d["pulls"]:
            out["avg_pull_ms"] = round(1000 * total_s / d["pulls"], 3)
            out["avg_acquire_ms"] = round(1000 * d["acquire_s"] / d["pulls"], 3)
            out["avg_read_ms"] = round(1000 * d["read_s"] / d["pulls"], 3)
            out["MB"] = round(d["bytes"] / 1e6, 3)
            out["GB/s"] = round(d["bytes"] / total_s / 1e9, 3) if total_s else 0.0
        out.update({k: d[k] for k in _GAUGES if d.get(k) is not None})
        return out


class MooncakePromMetrics(ConnectorPromMetrics):
    """``mooncake_vllm:*`` series on vLLM's own ``/metrics``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per_engine = self.per_engine

        c = self._counter_cls
        self._counters = {
            key: per_engine(c, f"mooncake_vllm:{key}", doc)
            for key, doc in (
                ("pulls", "KV pulls completed by this consumer"),
                ("pull_failures", "KV pulls that failed or timed out (then recomputed or failed)"),
                ("bytes", "KV bytes pulled"),
                ("blocks", "KV blocks pulled"),
                ("released", "producer leases released by the consumer"),
                ("expired", "producer leases ended by TTL"),
                ("evicted", "producer leases evicted over kv_buffer_size"),
                ("refused", "pulls the producer refused (unknown, ended or foreign blocks)"),
                (
                    "cancelled",
                    "pending pulls withdrawn: their request ended while its prefill computed",
                ),
                ("retries", "transfer-engine entries read again after a failed attempt"),
                ("stalls", "entry attempts the engine dropped for making no progress"),
                (
                    "layered",
                    "pulls that read layers while their prefill still computed "
                    "(the producer's layerwise_handoff)",
                ),
                (
                    "rejected_frames",
                    "side-channel frames dropped: not verifying, replayed, "
                    "malformed, too fast, or a release from a peer that did not acquire",
                ),
            )
        }
        buckets = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]
        self._histograms = {
            key: per_engine(self._histogram_cls, name, doc, buckets=buckets)
            for key, name, doc in (
                (
                    "durations_s",
                    "mooncake_vllm:pull_duration_seconds",
                    "Wall time of one KV pull (side channel + transfer engine)",
                ),
                (
                    "acquires_s",
                    "mooncake_vllm:acquire_duration_seconds",
                    "Acquire round trip of one pull (side channel, producer wait included)",
                ),
                (
                    "reads_s",
                    "mooncake_vllm:read_duration_seconds",
                    "Transfer-engine read of one pull, retries included",
                ),
            )
        }
        self._gauges = {
            key: per_engine(
                self._gauge_cls, f"mooncake_vllm:{key}", doc, multiprocess_mode="mostrecent"
            )
            for key, doc in (
                ("held_leases", "Finished prefills whose KV blocks are held for consumers"),
                (
                    "held_bytes",
                    "KV bytes the producer holds for consumers (all TP ranks; "
                    "bounded by kv_buffer_size per rank)",
                ),
            )
        }
