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
