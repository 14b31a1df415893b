"""The benchmarks run end to end and write what they promise: a table, JSON with every sample, a
PNG. Tiny sizes, no timing asserts (CI machines are noisy)."""

from __future__ import annotations

import json

from benchmarks import proxy, transfer

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
