"""Reading one metric from a Prometheus page: only its lines are parsed, with the same result as
parsing the whole page (pure, no server)."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import servers

PAGE = """\
# HELP mooncake_vllm:pulls Pulls.
# TYPE mooncake_vllm:pulls counter
mooncake_vllm:pulls_total{engine="0",model_name="a b} \\"c\\""} 3.0
mooncake_vllm:pulls_total{engine="1",model_name="m"} 4.0
mooncake_vllm:pulls_created{engine="0",model_name="m"} 1.7e+09
# HELP mooncake_vllm:pull_failures Failures.
# TYPE mooncake_vllm:pull_failures counter
mooncake_vllm:pull_failures_total{engine="0"} 1.0
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 12.0
vllm:prompt_tokens_by_source_total{source="local_compute"} 5.0
# TYPE vllm:x_seconds histogram
vllm:x_seconds_bucket{engine="0",le="0.1"} 1.0
vllm:x_seconds_bucket{engine="0",le="+Inf"} 2.0
vllm:x_seconds_bucket{engine="1",le="0.1"} 3.0
vllm:x_seconds_bucket{engine="1",le="+Inf"} 5.0
vllm:x_seconds_count{engine="0"} 2.0
vllm:x_seconds_sum{engine="0"} 0.3
# TYPE mooncake_vllm:held_leases gauge
mooncake_vllm:held_leases 2.0
mooncake_vllm:held_leases_max 9.0
"""


def _full(name: str, **labels: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(PAGE)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(servers, "http_text", lambda url, timeout_s=10.0: PAGE)
    return servers.VllmServer(None, "127.0.0.1", 1, "m")


@pytest.mark.parametrize(
    "name,labels",
    [
        ("mooncake_vllm:pulls_total", {}),
        ("mooncake_vllm:pulls_total", {"model_name": 'a b} "c"'}),
        ("mooncake_vllm:pulls_total", {"engine": "1"}),
        ("mooncake_vllm:pull_failures_total", {}),
        ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
        ("mooncake_vllm:held_leases", {}),
        ("mooncake_vllm:held_leases_max", {}),
        ("vllm:x_seconds_count", {}),
        ("no_such_metric", {}),
    ],
)
def test_one_metric_reads_as_from_the_whole_page(server, name, labels):
    assert server.metric(name, **labels) == _full(name, **labels)


def test_named_totals_and_histograms_read_as_from_the_whole_page(server):
    names = ["mooncake_vllm:pulls_total", "mooncake_vllm:held_leases", "absent_total"]
    every = server.metrics()
    assert server.metrics(names) == {n: every[n] for n in names if n in every}
    assert server.metrics(names)["mooncake_vllm:pulls_total"] == 7.0
    assert server.histogram("vllm:x_seconds") == {0.1: 4.0, float("inf"): 7.0}
