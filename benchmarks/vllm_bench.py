"""vLLM's own benchmark client (``vllm bench serve``) against our pair and against plain vLLM.

    python -m benchmarks.vllm_bench [--num-prompts N] [--concurrency 1,4,8] [--input-len 400,2000]
        [--output-len 16] [--datasets random,prefix_repetition] [--setups plain,pair,pair-placed]
        [--out-dir DIR]

Setups of the tiny local model on this machine, every server started with ``vllm serve MODEL``
(float32, eager, as ``harness.servers`` starts them) and all up together:

- ``plain``: one vLLM on 127.0.0.1, on every core of the host (``VLLM_CPU_OMP_THREADS_BIND`` of
  all of them);
- ``pair``: the README's pair on one host, as a user who sets nothing gets it: prefill and decode
  on 127.0.0.1 with ``MooncakeConnector`` (one ``mooncake.json``: P2P handshake, TCP; the guide's
  ``--kv-transfer-config``, vLLM's default failure policy), ``python proxy/proxy_server.py`` in
  front of them, each engine bound by vLLM's default (``auto``: every core, so both bind the same
  ones);
- ``pair-placed``: the same pair with each engine on its own cores (``harness.placement``: on two
  cores, prefill on core 0 and decode on core 1);
- ``pair-concurrent``: ``pair-placed`` with the proxy's ``--dispatch concurrent`` (the decode
  request leaves with the prefill request).

For each dataset, input length and concurrency, vLLM's client runs against each setup, one
after the other (a pause between, so the idle servers' post-request busy-wait is over). The
numbers are the client's own (its ``--save-result`` file): request throughput, TTFT, TPOT, ITL,
E2E latency, failed requests. For a pair, the decode's counters around the run: pulls, pull
failures (must be 0), retries and how its prompt tokens were sourced
(``vllm:prompt_tokens_by_source_total``: by external transfer, by its own prefix cache,
computed).

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
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from harness import placement, servers
from harness.pd import PULL_COUNTERS, ServerSpec, kv_args, mooncake_json, start_many
from harness.tiny_model import build_tiny_model
from harness.xpyd import start_proxy

NAME = "vllm_bench"
SETUPS = ("plain", "pair", "pair-placed", "pair-concurrent")
ENGINES = {"pair": "auto", "pair-placed": "placed", "pair-concurrent": "placed"}
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
    p.add_argument(
        "--num-prompts", type=int, default=None, help="per run (default: 16 per concurrent slot, "
        "at least 32)",
    )  # fmt: skip
    p.add_argument("--concurrency", type=_int_list, default=[8], help="comma list: 1,4,8")
    p.add_argument("--input-len", type=_int_list, default=[400], help="comma list: 400,2000")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-prefixes", type=int, default=10, help="prefix_repetition's prefixes")
    p.add_argument("--datasets", default="random,prefix_repetition")
    p.add_argument("--setups", default="plain,pair", help=f"comma list of {', '.join(SETUPS)}")
    args = p.parse_args(argv)
    args.setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    for x in args.setups:
        if x not in SETUPS:
            p.error(f"--setups: {x!r} is not one of {', '.join(SETUPS)}")
    return args


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def num_prompts(args, concurrency: int) -> int:
    return args.num_prompts or max(32, 16 * concurrency)


def dataset_args(name: str, args, input_len: int) -> list[str]:
    """vLLM's client flags for one dataset at one input length."""
    if name == "random":
        return [
            "--dataset-name", "random",
            "--random-input-len", str(input_len),
            "--random-output-len", str(args.output_len),
        ]  # fmt: skip
    if name == "prefix_repetition":
        prefix = input_len * 5 // 8
        return [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(prefix),
            "--prefix-repetition-suffix-len", str(input_len - prefix),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
        ]  # fmt: skip
    raise SystemExit(f"--datasets: {name!r} is not one of random, prefix_repetition")


def client_argv(
    model: str, base_url: str, dataset: str, args, cell: tuple[int, int], result: Path, seed: int
) -> list[str]:
    input_len, concurrency = cell
    return [
        VLLM, "bench", "serve",
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", model,
        *dataset_args(dataset, args, input_len),
        "--num-prompts", str(num_prompts(args, concurrency)),
        "--max-concurrency", str(concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--num-warmups", "8",
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
    "dataset", "input_len", "concurrency", "setup", "completed", "failed", "req_per_s",
    "ttft_mean", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99", "pulls",
    "pull_failures", "by_transfer", "by_decode_cache",
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


def start_servers(model: str, workdir: Path, log_dir: Path, setups: list[str]):
    """The setups' servers, all at once: {"plain": server, "pair": (prefill, decode), ...}."""
    everything = placement.bind_env(placement.host_cpus())
    specs: list[ServerSpec] = []
    if "plain" in setups:
        specs.append(ServerSpec("plain", HOST, env=everything, cli=True))
    # Engines by placement: "auto" (vLLM's default) for pair, "placed" for the other two, which
    # share one pair of engines (each with its own proxy).
    placements = {ENGINES[x] for x in setups if x != "plain"}
    for engines in sorted(placements):
        cfg = mooncake_json(
            workdir / f"mooncake-{engines}.json",
            prefill_url=f"{HOST}:{servers.free_port(HOST)}",
            decode_url=f"{HOST}:{servers.free_port(HOST)}",
        )
        env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
        if engines == "placed":
            binds = [placement.bind_env(c) for c in placement.split_cores(2)]
        else:  # vLLM's default, as a user who sets nothing gets it
            binds = [{"VLLM_CPU_OMP_THREADS_BIND": "auto", **_threads(everything)}] * 2
        roles = (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        for (role, kind), bind in zip(roles, binds, strict=True):
            spec_env = {**env, **bind}
            specs.append(ServerSpec(f"{role}-{engines}", HOST, kv_args(kind), spec_env, cli=True))
    up = dict(zip([s.name for s in specs], start_many(model, specs, log_dir=log_dir), strict=True))
    return {
        setup: up["plain"]
        if setup == "plain"
        else (up[f"prefill-{ENGINES[setup]}"], up[f"decode-{ENGINES[setup]}"])
        for setup in setups
    }


def _threads(env: dict[str, str]) -> dict[str, str]:
    return {"OMP_NUM_THREADS": env["OMP_NUM_THREADS"]}


def _command(srv) -> str:
    """How ``srv`` was started, with the environment that placed it."""
    env = getattr(srv.process, "env", None) or {}
    bind = {k: env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS") if k in env}
    return shlex.join([*(f"{k}={v}" for k, v in bind.items()), *srv.process.argv])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (kill, pkill) as an exception: the servers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for d in datasets:
        dataset_args(d, args, 1)  # a bad name stops here, before minutes of start-up
    raw_dir = common.samples_path_for(args.out_dir, NAME).parent
    raw_dir.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model())
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-"))
    started: list = []
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    try:
        print(f"starting {', '.join(args.setups)} (vllm serve) ...", flush=True)
        t0 = time.monotonic()
        up = start_servers(model, workdir, raw_dir, args.setups)
        urls: dict[str, str] = {}
        for setup, srv in up.items():
            if setup == "plain":
                started.append(srv)
                urls[setup] = srv.url
                commands["plain"] = _command(srv)
                continue
            prefill, decode = srv
            started += [s for s in (prefill, decode) if s not in started]
            dispatch = "concurrent" if setup == "pair-concurrent" else "sequential"
            proxy = start_proxy(
                ["--prefill", prefill.url, "--decode", decode.url, "--dispatch", dispatch],
                log_dir=raw_dir,
            )
            started.append(proxy)
            urls[setup] = proxy.url
            commands[setup] = " ; ".join(_command(s) for s in (prefill, decode, proxy))
        print(f"up after {time.monotonic() - t0:.0f} s", flush=True)
        cells = [(n, c) for n in args.input_len for c in args.concurrency]
        seeds = itertools.count()
        for dataset in datasets:
            for cell in cells:
                for setup in args.setups:
                    tag = f"{dataset}-{cell[0]}-c{cell[1]}-{setup}"
                    result = raw_dir / f"{tag}.json"
                    # Prompts of their own for every run: setups share engines (and caches).
                    seed = next(seeds)
                    argv = client_argv(model, urls[setup], dataset, args, cell, result, seed)
                    commands[tag] = shlex.join(argv)
                    time.sleep(QUIET_S)
                    decode = None if setup == "plain" else up[setup][1]
                    before = decode_counters(decode) if decode else None
                    print(f"{tag}: {shlex.join(argv[:3])} ...", flush=True)
                    r = run_client(argv, raw_dir / f"{tag}.log")
                    numbers = {
                        "dataset": dataset, "input_len": cell[0], "concurrency": cell[1],
                        "setup": setup, **client_numbers(r),
                    }  # fmt: skip
                    if decode is not None:
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
        f"every setup ran on the same {len(placement.host_cpus())} cores, one after the other",
        "plain: VLLM_CPU_OMP_THREADS_BIND of every core; pair: vLLM's default binding (auto) "
        "for both engines; pair-placed: each engine on its own cores (harness.placement); "
        "pair-concurrent: pair-placed behind --dispatch concurrent",
        "pairs: prefill and decode both on 127.0.0.1, P2P handshake over TCP, default failure "
        "policy (fail), behind python proxy/proxy_server.py",
        "times in ms, vLLM's client's own numbers (every percentile, output throughput and "
        "vLLM's per-request files: the samples file)",
        "pair only, from the decode's counters during the run (8 warm-up requests included): "
        "pulls and pull_failures; by_transfer and by_decode_cache, the shares of its prompt "
        "tokens by external KV transfer and by its own prefix cache (the rest: computed)",
    ]
    settings = {
        "num_prompts": {c: num_prompts(args, c) for c in args.concurrency},
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "setups": args.setups,
        "output_len": args.output_len,
        "num_prefixes": args.num_prefixes,
        "datasets": datasets,
        "model": "tiny-llama (harness.tiny_model), float32, --enforce-eager",
        "commands": commands,
    }
    paths = common.write_result(
        args.out_dir, NAME, settings=settings, samples=samples, rows=rows, notes=notes
    )
    common.report("vllm bench serve: plain vs pairs", rows, [paths.summary, paths.samples])
    bad = [r for r in rows if r["failed"] or r.get("pull_failures")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
