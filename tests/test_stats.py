"""Transfer statistics as vLLM aggregates and reduces them."""

from __future__ import annotations

from mooncake_vllm.p2p.stats import MooncakeStats


def test_stats_sum_counters_and_keep_the_newest_held_lease_count():
    worker, sched_a, sched_b = MooncakeStats(), MooncakeStats(), MooncakeStats()
    worker.record_pull(1000, 2, 3, duration_s=0.01, acquire_s=0.002, read_s=0.008)
    sched_a.count("released")
    sched_a.data["held_leases"] = 4
    sched_b.data["held_leases"] = 0
    assert MooncakeStats().is_empty()
    assert not sched_b.is_empty()  # a count that dropped to zero must still be reported
    total = worker.aggregate(sched_a).aggregate(sched_b)
    reduced = total.reduce()
    assert (reduced["pulls"], reduced["released"], reduced["held_leases"]) == (1, 1, 0)
    assert reduced["MB"] == 0.001


def _exposition(prom_cls, stats) -> dict[str, float]:
    """``prom_cls`` built as vLLM builds a connector's metrics (its own registry here), one
    engine's ``stats`` observed; every sample of the exposition, by name and labels."""
    import functools
    from types import SimpleNamespace

    import prometheus_client as pc
    from prometheus_client.parser import text_string_to_metric_families

    registry = pc.CollectorRegistry()
    types = {t: functools.partial(t, registry=registry) for t in (pc.Gauge, pc.Counter)}
    types[pc.Histogram] = functools.partial(pc.Histogram, registry=registry)
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = prom_cls(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    metrics.observe(stats.data, engine_idx=0)
    text = pc.generate_latest(registry).decode()
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_series_is_named_as_vllms_connectors_are_and_keeps_its_old_name_alike():
    """``vllm:mooncake_*`` (as vLLM's ``vllm:nixl_*``: what Dynamo's worker ``/metrics`` passes
    on) and the alias ``mooncake_vllm:*``, the same samples under both names."""
    from mooncake_vllm.p2p.stats import MooncakePromMetrics
    from mooncake_vllm.pool.stats import PoolPromMetrics, PoolStats

    p2p = MooncakeStats()
    p2p.record_pull(1000, 2, 3, duration_s=0.01, acquire_s=0.002, read_s=0.008)
    p2p.data["held_leases"] = 4
    pool = PoolStats()
    pool.count("lookups", 3)
    for cls, stats, some in (
        (MooncakePromMetrics, p2p, "vllm:mooncake_pulls_total"),
        (PoolPromMetrics, pool, "vllm:mooncake_pool_lookups_total"),
    ):
        samples = {k: v for k, v in _exposition(cls, stats).items() if "_created" not in k}
        new = {k: v for k, v in samples.items() if k.startswith("vllm:mooncake_")}
        old = {k: v for k, v in samples.items() if k.startswith("mooncake_vllm:")}
        assert samples[some + "[('engine', '0'), ('model_name', 'm')]"] > 0
        assert len(new) + len(old) == len(samples)
        assert {k.replace("vllm:mooncake_", "mooncake_vllm:"): v for k, v in new.items()} == old
    assert (
        _exposition(MooncakePromMetrics, p2p)[
            "vllm:mooncake_held_leases[('engine', '0'), ('model_name', 'm')]"
        ]
        == 4
    )
