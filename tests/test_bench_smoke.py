"""The benchmarks run end to end and write what they promise: a table, JSON with every sample, a
PNG. Tiny sizes, no timing asserts (CI machines are noisy)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from benchmarks import beside, proxy, serving, soak, transfer
from harness import servers

COMMON_KEYS = {"benchmark", "command", "machine", "versions", "settings", "notes", "rows"}


def _check_outputs(out_dir, name, capsys, row_keys):
    doc = json.loads((out_dir / f"{name}.json").read_text())
    assert doc.keys() >= COMMON_KEYS | {"samples"}
    assert doc["machine"]["cpu_count"] >= 1
    assert doc["samples"] and doc["rows"]
    assert doc["rows"][0].keys() >= row_keys
    png = out_dir / f"{name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert f"wrote {out_dir / f'{name}.json'}" in printed
    header = next(line for line in printed.splitlines() if line.startswith("|"))
    assert all(k in header for k in row_keys)
    return doc


def test_proxy_benchmark_writes_table_json_and_plot(tmp_path, capsys):
    rc = proxy.main(
        ["--out-dir", str(tmp_path), "--rounds", "1", "--per-round", "2", "--duration-s", "0.3"]
    )
    assert rc == 0
    doc = _check_outputs(tmp_path, "proxy", capsys, {"target", "p50_ms", "p99_ms", "max_rps"})
    assert {r["target"] for r in doc["rows"]} == set(proxy.TARGETS)
    assert {s["phase"] for s in doc["samples"]} == {"latency", "throughput"}


def test_transfer_benchmark_writes_table_json_and_plot(tmp_path, capsys):
    rc = transfer.main(
        ["--out-dir", str(tmp_path), "--reps", "1", "--tokens", "128", "--shapes", "tiny"]
    )
    assert rc == 0
    doc = _check_outputs(tmp_path, "transfer", capsys, {"tokens", "ours_GB/s", "ours/raw"})
    assert {s["method"] for s in doc["samples"]} == set(transfer.METHODS)
    assert {r["layout"] for r in doc["rows"]} == {"scattered", "contiguous"}


@pytest.mark.servers
def test_serving_benchmark_on_the_shared_cluster(pd, tmp_path, capsys):
    """One request per setup through the serving benchmark's client and writer, on the suite's
    plain server and prefill/decode pair behind our proxy (vLLM's built-in connector is left to
    ``make bench``: its servers would cost minutes to start)."""
    port = servers.free_port()
    proc = servers.ManagedProcess(
        "bench-proxy",
        [sys.executable, "-m", "mooncake_vllm.proxy.server", "--prefill", pd.prefill.url,
         "--decode", pd.decode.url, "--port", str(port), "--log-level", "warning"],
        tmp_path / "proxy.log",
    ).start()  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_until(lambda: servers.http_text(f"{url}/health") is not None, 60, "healthy")
        stack = serving.Stack.attach(pd.model, pd.plain, pd.prefill, pd.decode, url, tmp_path)
        samples, cells = serving.sweep(stack, [200], [1], requests=1, rounds=1, seed=1, quiet_s=0)
    finally:
        proc.stop()
    serving.record(tmp_path, stack, {"mode": "smoke"}, samples, cells)
    doc = _check_outputs(
        tmp_path, "serving", capsys, {"config", "ttft_p50", "itl_p99", "kv_ms/req"}
    )
    assert {r["config"] for r in doc["rows"]} == {"plain", "ours"}
    ours = next(r for r in doc["rows"] if r["config"] == "ours")
    assert ours["kv_ms/req"] == ours["kv_ms/req"]  # not NaN: the decode pulled the prompt
    # Where its TTFT went: the decode's vLLM histograms and the proxy's own, all counted.
    assert all(ours[k] == ours[k] for k in ("leg2_ms", "q2_ms", "pf2_ms", "px1_ms", "pxf_ms"))
    assert ours["pxf_ms"] > ours["px1_ms"] > 0  # the decode's first byte follows the prefill leg


@pytest.mark.servers
def test_soak_benchmark_runs_its_own_pair_and_counts_every_pull(tmp_path, capsys):
    rc = soak.main(["--out-dir", str(tmp_path), "--requests", "12", "--wave", "6", "--gap-s", "1"])
    doc = _check_outputs(tmp_path, "soak", capsys, {"requests", "failed", "pull_failures"})
    row = doc["rows"][0]
    assert rc == 0, row
    assert (row["requests"], row["failed"], row["pulls"], row["pull_failures"]) == (12, 0, 12, 0)
    assert row["ext_share"] >= 0.95


@pytest.mark.servers
def test_beside_benchmark_on_the_shared_cluster(pd, tmp_path, capsys):
    rows = asyncio.run(beside.measure(pd.model, pd.prefill, pd.decode, pulls=2, tokens=300))
    beside.record(tmp_path, rows, {"mode": "smoke"})
    doc = _check_outputs(tmp_path, "beside", capsys, {"phase", "itl_p99_ms", "decode_cpu_cores"})
    by_phase = {r["phase"]: r for r in doc["rows"]}
    assert by_phase["beside pulls"]["pulls"] == 2  # the decode pulled, it did not recompute
    assert all(r["itl_n"] > 0 for r in doc["rows"])
