"""vLLM's own benchmark client (``vllm bench serve``) against our pair and against plain vLLM.

    python -m benchmarks.vllm_bench [--num-prompts 200] [--concurrency 8] [--input-len 400]
        [--output-len 16] [--datasets random,prefix_repetition] [--out-dir DIR]

Two setups of the tiny local model on this machine, all three servers started with ``vllm serve
MODEL`` (float32, eager, as ``harness.servers`` starts them) and up together:

- ``plain``: one vLLM on 127.0.0.1;
- ``pair``: the README's pair on one host: prefill and decode on 127.0.0.1 with
  ``MooncakeConnector`` (one ``mooncake.json``: P2P handshake, TCP; the guide's
  ``--kv-transfer-config``, vLLM's default failure policy), ``python proxy/proxy_server.py`` in
  front of them.

For each dataset, vLLM's client runs against ``plain``, then against the proxy, one after the other
(a pause between, so the idle server's post-request busy-wait is over). The numbers are the
client's own (its ``--save-result`` file): request throughput, TTFT, TPOT, ITL, E2E latency,
failed requests. For the pair, the decode's counters around the run: pulls, pull failures (must be
0), retries and how its prompt tokens were sourced (``vllm:prompt_tokens_by_source_total``: by
external transfer, by its own prefix cache, computed).

Datasets: ``random`` (``--random-input-len``/``--random-output-len``, ``--ignore-eos``) and
``prefix_repetition`` (``--num-prefixes`` shared prefixes of ``input_len * 5 / 8`` tokens, the
rest a random suffix): both generated from the model's tokenizer, nothing downloaded.

The summary (machine, commands, commit, one row per setup and dataset) goes to
``<out-dir>/vllm_bench/vllm_bench.json``; vLLM's per-request files (``--save-detailed``) and the
server logs beside the samples file (``artifacts/vllm_bench/`` for a run into
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from harness import servers
from harness.pd import PULL_COUNTERS, ServerSpec, kv_args, mooncake_json, start_many
from harness.tiny_model import build_tiny_model
from harness.xpyd import start_proxy

NAME = "vllm_bench"
HOST = "127.0.0.1"
SOURCES = ("external_kv_transfer", "local_cache_hit", "local_compute")
QUIET_S = 2.0  # a vLLM worker busy-waits ~1 s after its last step: let it end between runs
VLLM = str(Path(sys.executable).with_name("vllm"))


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out-dir",
        type=Path,
        default=common.DEFAULT_OUT_DIR,
        help="where the result directory goes (%(default)s; committed: benchmarks/results)",
    )
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=400)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-prefixes", type=int, default=10, help="prefix_repetition's prefixes")
    p.add_argument("--datasets", default="random,prefix_repetition")
    return p.parse_args(argv)


def dataset_args(name: str, args) -> list[str]:
    """vLLM's client flags for one dataset at the run's lengths."""
    if name == "random":
        return [
            "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
        ]  # fmt: skip
    if name == "prefix_repetition":
        prefix = args.input_len * 5 // 8
        return [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(prefix),
            "--prefix-repetition-suffix-len", str(args.input_len - prefix),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
        ]  # fmt: skip
    raise SystemExit(f"--datasets: {name!r} is not one of random, prefix_repetition")


def client_argv(model: str, base_url: str, dataset: str, args, result: Path) -> list[str]:
    return [
        VLLM, "bench", "serve",
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", model,
        *dataset_args(dataset, args),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", "0", "--num-warmups", "8",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result", "--save-detailed",
        "--result-dir", str(result.parent), "--result-filename", result.name,
    ]  # fmt: skip


def run_client(argv: list[str], log: Path) -> dict[str, Any]:
    """Run vLLM's client to the end; its result file, or RuntimeError with its output's tail."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    result = Path(argv[argv.index("--result-dir") + 1]) / argv[argv.index("--result-filename") + 1]
    if code != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve exited {code}; {log}:\n{log.read_text()[-4000:]}")
    return json.loads(result.read_text())


def client_numbers(r: dict[str, Any]) -> dict[str, Any]:
    """Every number of vLLM's client result this benchmark keeps (times in ms)."""
    out = {
        "completed": r["completed"],
        "failed": r["failed"],
        "req_per_s": r["request_throughput"],
        "out_tok_per_s": r["output_throughput"],
        "in_tokens": r["total_input_tokens"],
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "p50", "p99"):
            out[f"{metric}_{stat}"] = r[f"{stat}_{metric}_ms"]
    return out


# The summary's columns; the rest of client_numbers and pair_numbers goes to the samples file.
ROW_COLUMNS = (
    "dataset", "setup", "completed", "failed", "req_per_s", "ttft_mean", "ttft_p50", "ttft_p99",
    "tpot_mean", "tpot_p99", "itl_mean", "itl_p99", "pulls", "pull_failures", "by_transfer",
    "by_decode_cache",
)  # fmt: skip


def decode_counters(decode: servers.VllmServer) -> dict[str, float]:
    out = PULL_COUNTERS.read(decode)
    for source in SOURCES:
        out[source] = decode.metric("vllm:prompt_tokens_by_source_total", source=source)
    return out


def settled_counters(
    decode: servers.VllmServer, before: dict[str, float], requests: int, timeout_s: float = 15.0
) -> dict[str, float]:
    """The decode's counters once every request's pull is counted (vLLM publishes them once per
    stats interval), or as they are at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = decode_counters(decode)
        if (
            now["pulls"] + now["pull_failures"]
            >= before["pulls"] + before["pull_failures"] + requests
            or time.monotonic() > deadline
        ):
            return now
        time.sleep(0.5)


def pair_numbers(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    delta = {k: after[k] - before[k] for k in after}
    prompt_tokens = sum(delta[s] for s in SOURCES)
    share = {s: delta[s] / prompt_tokens if prompt_tokens else float("nan") for s in SOURCES}
    return {
        "pulls": delta["pulls"],
        "pull_failures": delta["pull_failures"],
        "retries": delta["retries"],
        "by_transfer": share["external_kv_transfer"],
        "by_decode_cache": share["local_cache_hit"],
        "computed": share["local_compute"],
    }


def start_servers(model: str, workdir: Path, log_dir: Path):
    cfg = mooncake_json(
        workdir / "mooncake.json",
        prefill_url=f"{HOST}:{servers.free_port(HOST)}",
        decode_url=f"{HOST}:{servers.free_port(HOST)}",
    )
    env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
    specs = [
        ServerSpec("plain", HOST, cli=True),
        ServerSpec("prefill", HOST, kv_args("kv_producer"), env, cli=True),
        ServerSpec("decode", HOST, kv_args("kv_consumer"), env, cli=True),
    ]
    return start_many(model, specs, log_dir=log_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for d in datasets:
        dataset_args(d, args)  # a bad name stops here, before minutes of start-up
    raw_dir = common.samples_path_for(args.out_dir, NAME).parent
    raw_dir.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model())
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-"))
    started: list = []
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    try:
        print("starting plain, prefill and decode (vllm serve) ...", flush=True)
        t0 = time.monotonic()
        plain, prefill, decode = start_servers(model, workdir, raw_dir)
        started += [plain, prefill, decode]
        proxy = start_proxy(["--prefill", prefill.url, "--decode", decode.url], log_dir=raw_dir)
        started.append(proxy)
        print(f"up after {time.monotonic() - t0:.0f} s; proxy {proxy.url}", flush=True)
        commands["servers"] = " ; ".join(
            shlex.join(s.process.argv) for s in (plain, prefill, decode)
        )
        commands["proxy"] = shlex.join(proxy.process.argv)
        for dataset in datasets:
            for setup, url in (("plain", plain.url), ("pair", proxy.url)):
                result = raw_dir / f"{dataset}-{setup}.json"
                argv = client_argv(model, url, dataset, args, result)
                commands[f"{dataset}/{setup}"] = shlex.join(argv)
                time.sleep(QUIET_S)
                before = decode_counters(decode) if setup == "pair" else None
                print(f"{dataset} / {setup}: {shlex.join(argv[:3])} ...", flush=True)
                r = run_client(argv, raw_dir / f"{dataset}-{setup}.log")
                numbers = {"dataset": dataset, "setup": setup, **client_numbers(r)}
                if before is not None:
                    after = settled_counters(decode, before, r["completed"])
                    numbers.update(pair_numbers(before, after))
                row = {k: numbers.get(k) for k in ROW_COLUMNS}  # None: not measured (plain)
                rows.append(row)
                samples.append({**numbers, "result_file": str(result)})
                print(common.table([row]), flush=True)
    finally:
        for srv in reversed(started):
            srv.stop()
        servers.stop_all()
    notes = [
        "plain and pair ran in the same process tree on the same 2 cores, one after the other",
        "pair: prefill and decode both on 127.0.0.1, P2P handshake over TCP, default failure "
        "policy (fail), behind python proxy/proxy_server.py",
        "times in ms, vLLM's client's own numbers (every percentile, output throughput and "
        "vLLM's per-request files: the samples file)",
        "pair only, from the decode's counters during the run (8 warm-up requests included): "
        "pulls and pull_failures; by_transfer and by_decode_cache, the shares of its prompt "
        "tokens by external KV transfer and by its own prefix cache (the rest: computed)",
    ]
    settings = {
        "num_prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prefixes": args.num_prefixes,
        "datasets": datasets,
        "model": "tiny-llama (harness.tiny_model), float32, --enforce-eager",
        "commands": commands,
    }
    paths = common.write_result(
        args.out_dir, NAME, settings=settings, samples=samples, rows=rows, notes=notes
    )
    common.report("vllm bench serve: plain vs pair", rows, [paths.summary, paths.samples])
    bad = [r for r in rows if r["failed"] or r.get("pull_failures")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
