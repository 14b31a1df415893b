"""AIPerf (``pip install aiperf``, 0.13) replaying the committed Mooncake trace slice against a
plain vLLM, the README's pair behind our proxy (its default sequential dispatch, and ``--dispatch
concurrent``), and the same pair behind vLLM's router, in one run;
then each one's median latency of a short request at concurrency 1 and 8.

    python -m benchmarks.aiperf_trace [--requests N] [--length-div 4] [--time-mul 0.05]
        [--ttft-slo-ms 1000] [--itl-slo-ms 100] [--out-dir artifacts/bench]

``make bench-aiperf`` makes AIPerf's venv and the router's (``scripts/setup_tool.sh``) and runs
this. The trace is the one ``benchmarks.trace`` replays,
scaled the same way and written in the format AIPerf reads with ``--custom-dataset-type
mooncake_trace`` (``timestamp`` ms × ``--time-mul``, lengths ÷ ``--length-div``, outputs ÷ k
capped at ``--max-output-tokens``, the same ``hash_ids``, ``--isl-block-size`` 512/k); AIPerf
makes each hash id's text itself with the model's tokenizer and sends it at its time
(``--fixed-schedule``), streamed, to ``/v1/completions``. The targets replay one after the other
on engines started once (``plain``: vLLM as users run it; the pair: prefill and decode under
vLLM's default ``fail`` policy), every engine's prefix cache emptied before each replay.

Measured per target, from AIPerf's own ``profile_export_aiperf.json``: TTFT, ITL and request
latency percentiles, goodput under ``--goodput time_to_first_token:<ttft> inter_token_latency:
<itl>``; from the engines: prompt tokens computed (``vllm:prompt_tokens_by_source_total{source=
"local_compute"}``, all engines) against the trace's bound (tokens in blocks no earlier request
had), pulled by the decode (``external_kv_transfer``), and our pull failures. Then ``aiperf
profile`` with 8-token prompts and outputs at ``--concurrency`` 1 and 8: the median request
latency of each, and the proxy's and the router's added latency over plain.
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
from benchmarks.trace import DEFAULT_TRACE, MAX_MODEL_LEN, Stack, reset_caches, start_proxy
from benchmarks.trace_model import Scale, load_trace, new_tokens
from harness import servers
from harness.pd import ServerSpec, kv_args, mooncake_json, start_many
from harness.router import ROUTER_ENV, pd_args, router_binary, start_router
from harness.tiny_model import build_tiny_model

AIPERF_ENV = "MOONCAKE_VLLM_AIPERF"
TARGETS = ("plain", "proxy", "proxy-concurrent", "router")
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
METRICS = ("time_to_first_token", "inter_token_latency", "request_latency")


def aiperf_binary() -> str:
    default = Path.home() / ".cache" / "mooncake-vllm" / "aiperf-venv" / "bin" / "aiperf"
    path = os.environ.get(AIPERF_ENV, str(default))
    if not Path(path).exists():
        raise SystemExit(f"no aiperf at {path}: `make bench-aiperf` installs it ({AIPERF_ENV})")
    return path


def write_trace(path: Path, trace, scale: Scale) -> None:
    """The scaled trace in the format AIPerf's ``mooncake_trace`` loader reads."""
    first = min(r.timestamp_ms for r in trace)
    with path.open("w") as f:
        for r in trace:
            row = {
                "timestamp": round((r.timestamp_ms - first) * scale.time_mul),
                "input_length": scale.input_tokens(r),
                "output_length": scale.output_tokens(r),
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(row) + "\n")


TOKENIZER_REPO = "mooncake-vllm/tiny-model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")


def tokenizer_cache(model: str, hf_home: Path) -> str:
    """The model's tokenizer as a Hugging Face cache entry (``<hf_home>/hub/models--...``),
    named ``TOKENIZER_REPO``. AIPerf 0.13's worker processes load the tokenizer offline through
    ``snapshot_download(name, local_files_only=True)``, which refuses a local path ("Repo id must
    be in the form 'repo_name' or 'namespace/repo_name'"); a cache entry it finds."""
    repo = hf_home / "hub" / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(model) / name).exists() and not (snapshot / name).exists():
            (snapshot / name).symlink_to(Path(model) / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    return TOKENIZER_REPO


def run_aiperf(args: list[str], artifact_dir: Path, log: Path, timeout_s: float,
               hf_home: Path) -> dict:  # fmt: skip
    """``aiperf profile ARGS`` (no UI, artifacts under ``artifact_dir``, offline, its Hugging Face
    cache ``hf_home``); its summary JSON."""
    argv = [aiperf_binary(), "profile", *args, "--ui-type", "none",
            "--artifact-dir", str(artifact_dir)]  # fmt: skip
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=timeout_s,
                       env=env)  # fmt: skip
    found = sorted(artifact_dir.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {artifact_dir}")
    return json.loads(found[-1].read_text())


def stat(summary: dict, tag: str, key: str) -> float | None:
    """One statistic (``p50``, ``p99``, ``avg``) of one AIPerf metric, in its display unit."""
    entry = summary.get(tag)
    if not isinstance(entry, dict):
        return None
    value = entry.get(key)
    return float(value) if value is not None else None


def engine_counts(engines: dict[str, servers.VllmServer]) -> dict[str, float]:
    out = {"computed": 0.0, "pulled": 0.0, "pull_failures": 0.0}
    for srv in engines.values():
        out["computed"] += srv.metric(BY_SOURCE, source="local_compute")
        out["pulled"] += srv.metric(BY_SOURCE, source="external_kv_transfer")
        out["pull_failures"] += srv.metric("vllm:mooncake_pull_failures_total")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    ap.add_argument("--length-div", type=int, default=4)
    ap.add_argument("--time-mul", type=float, default=0.05)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--itl-slo-ms", type=float, default=100.0)
    ap.add_argument("--latency-requests", type=int, default=40, help="per concurrency and target")
    ap.add_argument("--name", default="aiperf_trace")
    args = ap.parse_args(argv)
    if router_binary() is None:
        ap.error(f"{ROUTER_ENV} names no vllm-router (`make bench-aiperf` sets it)")
    trace = load_trace(args.trace)[: args.requests]
    scale = Scale(args.length_div, args.time_mul, args.max_output_tokens)
    bound = sum(new_tokens(trace, scale))
    prompt_tokens = sum(scale.input_tokens(r) for r in trace)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-aiperf-"))
    log_dir = workdir / "logs"
    log_dir.mkdir()
    trace_file = workdir / "trace.jsonl"
    write_trace(trace_file, trace, scale)
    model = str(build_tiny_model())
    env = {"MOONCAKE_CONFIG_PATH": str(mooncake_json(workdir / "mooncake.json")),
           "VLLM_SERVER_DEV_MODE": "1"}  # fmt: skip  # POST /reset_prefix_cache between runs
    common_args = ["--max-model-len", str(MAX_MODEL_LEN)]
    specs = [
        ServerSpec("aiperf-plain", "127.0.0.1", common_args, {"VLLM_SERVER_DEV_MODE": "1"}),
        ServerSpec("aiperf-prefill", "127.0.0.2", [*common_args, *kv_args("kv_producer")], env),
        ServerSpec("aiperf-decode", "127.0.0.3", [*common_args, *kv_args("kv_consumer")], env),
    ]
    rows, samples = [], []
    started: list = []
    try:
        t0 = time.monotonic()
        plain, prefill, decode = start_many(model, specs, timeout_s=1200, log_dir=log_dir)
        started += [plain, prefill, decode]
        pair = ["--prefill", prefill.url, "--decode", decode.url]
        proxy_url = start_proxy(pair, log_dir, "aiperf-proxy", started)
        concurrent_url = start_proxy([*pair, "--dispatch", "concurrent"], log_dir,
                                     "aiperf-proxy-concurrent", started)  # fmt: skip
        router = start_router([*pd_args([(prefill.url, 8998)], [decode.url], "mooncake"),
                               "--policy", "round_robin"], log_dir=log_dir)  # fmt: skip
        started.append(router)
        print(f"up in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        urls = {"plain": plain.url, "proxy": proxy_url, "proxy-concurrent": concurrent_url,
                "router": router.url}  # fmt: skip
        engines = {t: {"p": prefill, "d": decode} for t in TARGETS}
        engines["plain"] = {"plain": plain}
        hf_home = workdir / "hf"
        base = ["--model", model, "--tokenizer", tokenizer_cache(model, hf_home),
                "--endpoint-type", "completions", "--streaming", "--workers-max", "2",
                "--random-seed", "0",
                "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0"]  # fmt: skip
        for url in urls.values():  # first connections, first steps: not in any target's figures
            for n in (600, 8):
                servers.http_json(f"{url}/v1/completions", {"model": model, "max_tokens": 4,
                                                            "prompt": [7] * n})  # fmt: skip
        for target in TARGETS:
            reset_caches(Stack({}, {"plain": plain, "prefill": prefill, "decode": decode}))
            time.sleep(1.5)
            before = engine_counts(engines[target])
            t1 = time.monotonic()
            summary = run_aiperf(
                [*base, "--url", urls[target], "--input-file", str(trace_file),
                 "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
                 "--isl-block-size", str(scale.block_tokens),
                 "--goodput", f"time_to_first_token:{args.ttft_slo_ms} "
                 f"inter_token_latency:{args.itl_slo_ms}"],
                workdir / f"trace-{target}", log_dir / "aiperf.log", 1800, hf_home,
            )  # fmt: skip
            took = time.monotonic() - t1
            time.sleep(2.0)
            moved = {k: v - before[k] for k, v in engine_counts(engines[target]).items()}
            row: dict[str, Any] = {"target": target, "replay_s": took}
            for tag in METRICS:
                for key in ("p50", "p90", "p99"):
                    row[f"{tag}_{key}"] = stat(summary, tag, key)
            row["goodput_req_s"] = stat(summary, "goodput", "avg")
            row["throughput_req_s"] = stat(summary, "request_throughput", "avg")
            row["requests"] = stat(summary, "request_count", "avg")
            row["errors"] = stat(summary, "error_request_count", "avg") or 0.0
            row["computed_x_bound"] = moved["computed"] / bound
            row["pulled_x_least"] = moved["pulled"] / bound if moved["pulled"] else None
            row["pull_failures"] = moved["pull_failures"]
            samples.append({"target": target, "aiperf": summary, "engines": moved})
            for c in (1, 8):
                lat = run_aiperf(
                    [*base, "--url", urls[target], "--concurrency", str(c),
                     "--request-count", str(args.latency_requests),
                     "--warmup-request-count", str(c), "--isl", "8", "--osl", "8"],
                    workdir / f"latency-{target}-c{c}", log_dir / "aiperf.log", 600, hf_home,
                )  # fmt: skip
                row[f"latency_c{c}_p50_ms"] = stat(lat, "request_latency", "p50")
                samples.append({"target": target, "concurrency": c, "aiperf": lat})
            rows.append(row)
    finally:
        for s in reversed(started):
            s.stop()
        servers.stop_all()
    plain_row = next(r for r in rows if r["target"] == "plain")
    for row in rows:
        for c in (1, 8):
            key = f"latency_c{c}_p50_ms"
            if row[key] is not None and plain_row[key] is not None:
                row[f"added_c{c}_ms"] = row[key] - plain_row[key]
    settings = {
        "trace": common._display_path(args.trace), "requests": len(trace),
        "length_div": args.length_div, "block_tokens": scale.block_tokens,
        "time_mul": args.time_mul, "max_output_tokens": args.max_output_tokens,
        "ttft_slo_ms": args.ttft_slo_ms, "itl_slo_ms": args.itl_slo_ms,
        "prompt_tokens": prompt_tokens, "bound_tokens": bound, "max_model_len": MAX_MODEL_LEN,
        "aiperf": aiperf_binary(), "router": router_binary(), "log_dir": str(log_dir),
    }  # fmt: skip
    notes = [
        "AIPerf 0.13 makes the prompts (its own text per hash id, the model's tokenizer), sends "
        "them at the trace's scaled times and measures TTFT/ITL; answers are not compared here "
        "(the suite's router and proxy tests compare them token by token)",
        "computed: vllm:prompt_tokens_by_source_total{source=local_compute} over the target's "
        "engines, against the bound (tokens in first-seen hash blocks); text prompts tokenize "
        "to blocks that only approximately align with the trace's, so ~1.0x is the mark",
        "added_cN_ms: median latency of an 8-token prompt with 8 output tokens at concurrency "
        "N, minus plain vLLM's, in the same run",
    ]
    paths = common.write_result(args.out_dir, args.name, settings=settings, samples=samples,
                                rows=rows, notes=notes, plot=plot(rows))  # fmt: skip
    common.report(f"AIPerf trace replay: {len(trace)} requests, bound {bound} tokens", rows, paths)
    return 0


def plot(rows: list[dict]) -> Callable[[Path], None]:
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        labels = [r["target"] for r in rows]
        x = range(len(rows))
        for i, key in enumerate(("p50", "p99")):
            ax1.bar([j + 0.4 * i for j in x], [r[f"time_to_first_token_{key}"] or 0 for r in rows],
                    width=0.4, label=f"TTFT {key}")  # fmt: skip
        ax1.set_xticks([j + 0.2 for j in x], labels)
        ax1.set_ylabel("ms (AIPerf)")
        ax1.legend(fontsize=8)
        for i, c in enumerate((1, 8)):
            ax2.bar([j + 0.4 * i for j in x], [r[f"latency_c{c}_p50_ms"] or 0 for r in rows],
                    width=0.4, label=f"8-token request, c={c}")  # fmt: skip
        ax2.set_xticks([j + 0.2 for j in x], labels)
        ax2.set_ylabel("median request latency (ms)")
        ax2.legend(fontsize=8)
        common.save_figure(fig, path, "AIPerf: Mooncake trace slice (scaled) and short requests")

    return draw


if __name__ == "__main__":
    sys.exit(main())
