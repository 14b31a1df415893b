"""The benchmarks run end to end and write what they promise: a table, a summary with a small PNG
(what ``benchmarks/results`` commits) and the raw samples it names. Tiny sizes, no timing asserts
(CI machines are noisy)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks import beside, common, proxy, serving, soak, tables, transfer
from harness import servers
from harness.xpyd import start_pair_proxy

SUMMARY_KEYS = {"benchmark", "finished_utc", "command", "machine", "versions", "commit",
                "settings", "notes", "samples_file", "rows"}  # fmt: skip


def _head_sha() -> str | None:
    """This checkout's commit (the code the benchmarks import), None outside a git work tree."""
    try:
        return subprocess.run(
            ["git", "-C", str(common.REPO_DIR), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def _check_outputs(out_dir, name, capsys, row_keys, samples_dir=None):
    """The summary (no samples), its PNG, the samples file it names (beside it unless the run was
    for the committed results), and the printed table."""
    summary_path = out_dir / name / f"{name}.json"
    summary = json.loads(summary_path.read_text())
    assert summary.keys() == SUMMARY_KEYS
    assert summary["benchmark"] == name
    assert summary["machine"]["cpu_count"] >= 1
    head = _head_sha()
    if head is None:
        assert summary["commit"] is None
    else:
        assert summary["commit"]["sha"] == head
        assert isinstance(summary["commit"]["dirty"], bool)
    assert summary["rows"] and summary["rows"][0].keys() >= row_keys
    samples_path = (samples_dir or out_dir / name) / f"{name}-samples.json"
    assert (common.REPO_DIR / summary["samples_file"]).resolve() == samples_path.resolve()
    raw = json.loads(samples_path.read_text())
    assert raw["samples"] and raw["rows"] == summary["rows"]
    png = out_dir / name / f"{name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size < 60_000  # small enough to commit
    printed = capsys.readouterr().out
    assert f"wrote {summary_path}" in printed
    header = next(line for line in printed.splitlines() if line.startswith("|"))
    assert all(k in header for k in row_keys)
    return SimpleNamespace(**summary, samples=raw["samples"])


@pytest.mark.parametrize("committed", [True, False], ids=["for-results", "scratch"])
def test_write_result_keeps_samples_out_of_the_summary(tmp_path, monkeypatch, capsys, committed):
    """A run for the committed results puts its samples under the ignored artifacts/; any other
    run keeps them beside its summary (and so cannot overwrite the committed run's)."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "repo" / "benchmarks" / "results")
    monkeypatch.setattr(common, "ARTIFACTS_DIR", tmp_path / "repo" / "artifacts")
    out_dir = common.RESULTS_DIR if committed else tmp_path / "scratch"

    def plot(path):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        ax.plot([1, 2, 3], [3, 1, 2], "-o", label="ours")
        ax.legend()
        common.save_figure(fig, path, "a plot")

    samples = [{"cell": 1, "ms": 1.5}, {"cell": 1, "ms": 2.5}]
    rows = [{"cell": 1, "p50_ms": 2.0}]
    paths = common.write_result(
        out_dir, "demo", settings={"n": 2}, samples=samples, rows=rows, plot=plot
    )
    common.report("demo", rows, paths)
    samples_dir = common.ARTIFACTS_DIR / "demo" if committed else None
    doc = _check_outputs(out_dir, "demo", capsys, {"cell", "p50_ms"}, samples_dir)
    assert doc.samples == samples
    assert sorted(p.name for p in (out_dir / "demo").iterdir()) == (
        ["demo.json", "demo.png"] if committed else ["demo-samples.json", "demo.json", "demo.png"]
    )


def test_docs_tables_match_the_committed_results():
    """docs/benchmarks.md shows the committed summaries; regenerate it after committing a result
    (``python -m benchmarks.tables --update docs/benchmarks.md``)."""
    docs = common.REPO_DIR / "docs" / "benchmarks.md"
    assert tables.main(["--update", str(docs), "--check"]) == 0


def test_proxy_benchmark_writes_table_json_and_plot(tmp_path, capsys):
    rc = proxy.main(
        ["--out-dir", str(tmp_path), "--rounds", "1", "--per-round", "2", "--duration-s", "0.3"]
    )
    assert rc == 0
    doc = _check_outputs(tmp_path, "proxy", capsys, {"target", "p50_ms", "p99_ms", "max_rps"})
    assert {r["target"] for r in doc.rows} == set(proxy.TARGETS)
    assert {s["phase"] for s in doc.samples} == {"latency", "throughput"}
    cpu = {r["target"]: r["server_cpu_us_per_req"] for r in doc.rows}
    assert all(cpu[t] > 0 for t in cpu if t.startswith("ours_") or t == "toy"), cpu
    assert math.isnan(cpu["direct"]) and math.isnan(cpu["direct_2leg"]), cpu


def test_transfer_benchmark_writes_table_json_and_plot(tmp_path, capsys):
    rc = transfer.main(
        ["--out-dir", str(tmp_path), "--reps", "1", "--tokens", "128", "--shapes", "tiny"]
    )
    assert rc == 0
    doc = _check_outputs(
        tmp_path, "transfer", capsys, {"tokens", "layout", "ours_GB/s", "vs_same", "ours/raw"}
    )
    assert {s["method"] for s in doc.samples} == set(transfer.METHODS)
    assert {r["ids"] for r in doc.rows} == {"scattered", "contiguous"}
    assert [(r["ids"], r["layout"]) for r in doc.rows] == [
        (ids, layout) for ids in ("contiguous", "scattered") for layout in transfer.LAYOUTS
    ]
    same, split, resize = doc.rows[:3]
    assert split["MB"] == same["MB"] / 2 and resize["MB"] == same["MB"]
    assert resize["scatter"] > 0 and same["scatter"] is None and split["raw_te_GB/s"] is None


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
        proc.wait_until(
            lambda: json.loads(servers.http_text(f"{url}/health"))["status"] == "ok", 60, "healthy"
        )
        stack = serving.Stack.attach(pd.model, pd.plain, pd.prefill, pd.decode, url, tmp_path)
        samples, cells = serving.sweep(stack, [200], [1], requests=1, rounds=1, seed=1, quiet_s=0)
    finally:
        proc.stop()
    serving.record(tmp_path, stack, {"mode": "smoke"}, samples, cells)
    doc = _check_outputs(
        tmp_path, "serving", capsys, {"config", "ttft_p50", "itl_p99", "kv_ms/req"}
    )
    assert {r["config"] for r in doc.rows} == {"plain", "ours"}
    ours = next(r for r in doc.rows if r["config"] == "ours")
    assert ours["kv_ms/req"] == ours["kv_ms/req"]  # not NaN: the decode pulled the prompt
    # Where its TTFT went: the decode's vLLM histograms and the proxy's own, all counted.
    assert all(ours[k] == ours[k] for k in ("leg2_ms", "q2_ms", "pf2_ms", "px1_ms", "pxf_ms"))
    assert ours["pxf_ms"] > ours["px1_ms"] > 0  # the decode's first byte follows the prefill leg


@pytest.mark.servers
def test_soak_benchmark_counts_every_pull(pd, tmp_path, capsys):
    """On the shared pair (its own one-host pair costs a minute of starts; the new-user tests
    start that setup)."""
    argv = ["--out-dir", str(tmp_path), "--requests", "12", "--wave", "6", "--gap-s", "1"]
    with servers.running(start_pair_proxy(pd.prefill.url, pd.decode.url)) as proxy:
        rc = soak.main(argv, attach=(pd.model, pd.prefill, pd.decode, proxy.url))
    doc = _check_outputs(tmp_path, "soak", capsys, {"requests", "failed", "pull_failures"})
    row = doc.rows[0]
    assert rc == 0, row
    assert (row["requests"], row["failed"], row["pulls"], row["pull_failures"]) == (12, 0, 12, 0)
    assert row["ext_share"] >= 0.95


@pytest.mark.servers
def test_beside_benchmark_on_the_shared_cluster(pd, tmp_path, capsys):
    rows = asyncio.run(beside.measure(pd.model, pd.prefill, pd.decode, pulls=2, tokens=300))
    beside.record(tmp_path, rows, {"mode": "smoke"})
    doc = _check_outputs(tmp_path, "beside", capsys, {"phase", "itl_p99_ms", "decode_cpu_cores"})
    by_phase = {r["phase"]: r for r in doc.rows}
    assert by_phase["beside pulls"]["pulls"] == 2  # the decode pulled, it did not recompute
    assert all(r["itl_n"] > 0 for r in doc.rows)
