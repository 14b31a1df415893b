"""The parts of ``benchmarks.aiperf_trace`` and ``benchmarks.guidellm_sweep`` that are ours: the
trace written in AIPerf's ``mooncake_trace`` format, the tokenizer as a Hugging Face cache entry
AIPerf's offline workers find, and the figures read back from each tool's JSON report (the shapes
AIPerf 0.13 and guidellm 0.8 wrote in ``make bench-aiperf`` / ``make bench-guidellm``)."""

from __future__ import annotations

import json

from benchmarks.aiperf_trace import stat, tokenizer_cache, write_trace
from benchmarks.guidellm_sweep import rows_of
from benchmarks.trace_model import Scale, TraceRequest


def test_the_trace_is_written_scaled_in_aiperfs_format(tmp_path):
    blocks = tuple(range(15))  # 7322 tokens: 15 blocks of 512
    trace = [TraceRequest(3000, 7322, 490, blocks), TraceRequest(4000, 100, 2, (0,))]
    out = tmp_path / "t.jsonl"
    write_trace(out, trace, Scale(4, 0.05, 32))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [
        {"timestamp": 0, "input_length": 1831, "output_length": 32, "hash_ids": list(blocks)},
        {"timestamp": 50, "input_length": 25, "output_length": 1, "hash_ids": [0]},
    ]


def test_the_tokenizer_is_a_cache_entry_that_resolves_offline(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "tokenizer_config.json").write_text("{}")
    name = tokenizer_cache(str(model), tmp_path / "hf")
    repo = tmp_path / "hf" / "hub" / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text()
    assert (snapshot / "tokenizer.json").resolve() == model / "tokenizer.json"
    assert not (snapshot / "chat_template.jinja").exists()  # only files the model has
    assert tokenizer_cache(str(model), tmp_path / "hf") == name  # again: nothing changes


def test_aiperf_figures_are_read_by_metric_and_statistic():
    summary = {"time_to_first_token": {"unit": "ms", "p50": 236.2, "p99": 4542.6},
               "goodput": {"unit": "requests/sec", "avg": 0.32}}  # fmt: skip
    assert stat(summary, "time_to_first_token", "p50") == 236.2
    assert stat(summary, "goodput", "avg") == 0.32
    assert stat(summary, "inter_token_latency", "p50") is None
    assert stat(summary, "time_to_first_token", "p90") is None


def test_guidellm_rows_one_per_benchmark_of_the_sweep():
    bench = {
        "config": {"strategy": {"type_": "constant", "rate": 4.12}},
        "metrics": {
            "requests_per_second": {"successful": {"mean": 3.75}},
            "time_to_first_token_ms": {"successful": {"percentiles": {"p50": 280.0, "p99": 654}}},
            "inter_token_latency_ms": {"successful": {"percentiles": {"p50": 7.5}}},
            "request_latency": {"successful": {"percentiles": {"p50": 0.539, "p99": 0.937}}},
            "request_totals": {"successful": 31, "errored": 0},
        },
    }
    (row,) = rows_of("pair", {"benchmarks": [bench]})
    assert row["strategy"] == "constant" and row["rate"] == 4.12 and row["req_per_s"] == 3.75
    assert (row["ttft_p50_ms"], row["itl_p50_ms"], row["latency_p99_ms"]) == (280.0, 7.5, 937.0)
    assert (row["completed"], row["errored"]) == (31, 0)
