"""guidellm's sweep (``pip install guidellm``, 0.8) on the README's pair behind our proxy and on a
plain vLLM: synchronous, throughput, then constant rates between, each rate for a fixed time.

    python -m benchmarks.guidellm_sweep [--prompt-tokens 512] [--output-tokens 32]
        [--sweep-size 5] [--seconds 20] [--out-dir artifacts/bench]

``make bench-guidellm`` makes guidellm's venv (``scripts/setup_tool.sh``) and runs this. Both
targets run one after the other on engines started once (the pair under vLLM's default ``fail``
policy), with guidellm's synthetic text of ``--prompt-tokens`` and ``--output-tokens`` (the
model's tokenizer), streamed ``/v1/completions``, its JSON report kept as the samples. Per
benchmark of the sweep: the rate guidellm held, requests per second completed, TTFT, ITL and
request latency percentiles; and the decode's pulls and pull failures over the target's sweep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.trace import start_proxy
from harness import servers
from harness.pd import ServerSpec, kv_args, mooncake_json, start_many
from harness.tiny_model import build_tiny_model

GUIDELLM_ENV = "MOONCAKE_VLLM_GUIDELLM"


def guidellm_binary() -> str:
    default = Path.home() / ".cache" / "mooncake-vllm" / "guidellm-venv" / "bin" / "guidellm"
    path = os.environ.get(GUIDELLM_ENV, str(default))
    if not Path(path).exists():
        raise SystemExit(f"no guidellm at {path}: `make bench-guidellm` installs it")
    return path


def scenario(url: str, model: str, args) -> dict[str, Any]:
    """guidellm's scenario file: the sweep, synthetic text, a time limit per benchmark."""
    return {
        "metadata": {"name": "mooncake-vllm-sweep"},
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "request_format": "/v1/completions",
                "stream": True,
            },
            "profile": {"kind": "sweep", "sweep_size": args.sweep_size},
            "tokenizer": {"kind": "hf_auto", "model": model},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens,
                }
            ],
            "constraints": [{"kind": "max_duration", "seconds": args.seconds}],
        },
    }


def run_guidellm(spec: dict, workdir: Path, name: str, log: Path) -> dict:
    path, report = workdir / f"{name}.scenario.json", workdir / f"{name}.report.json"
    path.write_text(json.dumps(spec, indent=2))
    argv = [guidellm_binary(), "run", "--config", str(path), "--output",
            f"kind=json,path={report}", "--disable-console-interactive"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=3600,
                       env=env)  # fmt: skip
    return json.loads(report.read_text())


def _find(d: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def rows_of(target: str, report: dict) -> list[dict]:
    """One row per benchmark of the sweep, from guidellm's report (its metric summaries of
    successful requests)."""
    rows = []
    for bench in report.get("benchmarks", []):
        metrics = bench.get("metrics", {})
        strategy = _find(bench, "config", "strategy") or {}
        row: dict[str, Any] = {
            "target": target,
            "strategy": strategy.get("type_"),
            "rate": strategy.get("rate"),
            "req_per_s": _find(metrics, "requests_per_second", "successful", "mean"),
        }
        for key, name in (("ttft", "time_to_first_token_ms"), ("itl", "inter_token_latency_ms"),
                          ("latency", "request_latency")):  # fmt: skip
            dist = _find(metrics, name, "successful") or {}
            pct = dist.get("percentiles") or {}
            scale = 1000.0 if name == "request_latency" else 1.0
            for q in ("p50", "p99"):
                if pct.get(q) is not None:
                    row[f"{key}_{q}_ms"] = pct[q] * scale
        totals = _find(metrics, "request_totals") or {}
        row["completed"] = totals.get("successful")
        row["errored"] = totals.get("errored")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--sweep-size", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=20.0, help="each benchmark of the sweep")
    ap.add_argument("--name", default="guidellm_sweep")
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-guidellm-"))
    log_dir = workdir / "logs"
    log_dir.mkdir()
    model = str(build_tiny_model())
    env = {"MOONCAKE_CONFIG_PATH": str(mooncake_json(workdir / "mooncake.json"))}
    specs = [
        ServerSpec("guidellm-plain", "127.0.0.1"),
        ServerSpec("guidellm-prefill", "127.0.0.2", kv_args("kv_producer"), env),
        ServerSpec("guidellm-decode", "127.0.0.3", kv_args("kv_consumer"), env),
    ]
    rows, samples, started = [], [], []
    try:
        plain, prefill, decode = start_many(model, specs, timeout_s=1200, log_dir=log_dir)
        started += [plain, prefill, decode]
        proxy = start_proxy(["--prefill", prefill.url, "--decode", decode.url], log_dir,
                            "guidellm-proxy", started)  # fmt: skip
        for target, url in (("plain", plain.url), ("pair", proxy)):
            pulls0 = decode.metric("vllm:mooncake_pulls_total")
            failed0 = decode.metric("vllm:mooncake_pull_failures_total")
            t0 = time.monotonic()
            report = run_guidellm(scenario(url, model, args), workdir, target,
                                  log_dir / "guidellm.log")  # fmt: skip
            print(f"{target}: sweep in {time.monotonic() - t0:.0f}s", file=sys.stderr)
            time.sleep(2.0)
            for row in rows_of(target, report):
                row["pulls"] = decode.metric("vllm:mooncake_pulls_total") - pulls0
                row["pull_failures"] = decode.metric("vllm:mooncake_pull_failures_total") - failed0
                rows.append(row)
            samples.append({"target": target, "report": report})
    finally:
        for s in reversed(started):
            s.stop()
        servers.stop_all()
    settings = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                "sweep_size": args.sweep_size, "seconds_per_benchmark": args.seconds,
                "guidellm": guidellm_binary(), "log_dir": str(log_dir)}  # fmt: skip
    notes = [
        "guidellm 0.8 sweep: synchronous, throughput, then constant rates between; each for "
        "seconds_per_benchmark; figures from its JSON report (successful requests)",
        "pulls, pull_failures: the decode's counters over the whole sweep of the target "
        "(the same value on each of its rows)",
    ]
    paths = common.write_result(args.out_dir, args.name, settings=settings, samples=samples,
                                rows=rows, notes=notes, plot=plot(rows))  # fmt: skip
    common.report("guidellm sweep: plain vLLM and the pair behind our proxy", rows, paths)
    return 0


def plot(rows: list[dict]) -> Callable[[Path], None]:
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for target in dict.fromkeys(r["target"] for r in rows):
            mine = sorted((r for r in rows if r["target"] == target and r.get("req_per_s")),
                          key=lambda r: r["req_per_s"])  # fmt: skip
            ax1.plot([r["req_per_s"] for r in mine], [r.get("ttft_p50_ms") for r in mine], "o-",
                     label=target)  # fmt: skip
            ax2.plot([r["req_per_s"] for r in mine], [r.get("itl_p50_ms") for r in mine], "o-",
                     label=target)  # fmt: skip
        ax1.set_xlabel("requests/s completed")
        ax1.set_ylabel("TTFT p50 (ms)")
        ax2.set_xlabel("requests/s completed")
        ax2.set_ylabel("ITL p50 (ms)")
        ax1.legend(fontsize=8)
        common.save_figure(fig, path, "guidellm sweep: plain vLLM and the pair (tiny model)")

    return draw


if __name__ == "__main__":
    sys.exit(main())
