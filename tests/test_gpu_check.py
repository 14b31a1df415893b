"""The prepared GPU check (``scripts/gpu_check.py``) run the way it runs on a GPU host, on CPU
tensors with the non-CUDA transfer engine: two processes, vLLM's CUDA KV layout, every byte
checked, both rates and the JSON summary written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_check_pulls_every_byte_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/gpu_check.py"), "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["mismatched_bytes"] == 0 and summary["stray_bytes"] == 0
    layers, num_blocks, block, heads, head = 4, 64, 16, 4, 64
    assert summary["layout"]["shape_per_layer"] == [2, num_blocks, block, heads, head]
    pulled = summary["layout"]["pulled_blocks"]
    assert summary["bytes"] == layers * 2 * pulled * block * heads * head * 4
    assert summary["protocol"] == "tcp"
    for side in ("ours", "raw_engine"):
        assert summary[side]["gbps_median"] > 0
    assert summary["ratio_to_raw"] > 0
    assert "raw engine" in done.stdout and "wrong bytes 0" in done.stdout
