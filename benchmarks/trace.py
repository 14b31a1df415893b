"""Replay of a Mooncake trace, scaled to this box: SLO attainment, goodput, and prompt tokens
computed against the trace's own reuse bound.

    python -m benchmarks.trace [--targets plain,pair,2p2d,pool] [--policy prefix,round_robin]
        [--trace benchmarks/traces/conversation_slice.jsonl] [--length-div 4] [--time-mul 0.05]
        [--requests N] [--out-dir artifacts/bench]

The trace (default: the committed 100-request slice of whole conversations of Mooncake's FAST'25
conversation trace, see ``benchmarks/traces/README.md``) is scaled by stated factors: token lengths
÷ ``--length-div`` (a 512-token hash block becomes 512/k tokens: k = 4 gives 128, vLLM's CPU block),
arrival times × ``--time-mul``, outputs ÷ k capped at ``--max-output-tokens``. Each hash id stands
for one fixed block of token ids, so equal ``hash_ids`` are equal prompt blocks and a cache can
reuse exactly what the trace says it could. Each conversation is a client: a turn is sent at its
scaled arrival time, but not before the previous turn of the same conversation has its answer
(a user answers what they read).

Targets, each started fresh (tiny model, ``--max-model-len`` 4096), one after the other:
``plain`` one vLLM; ``pair`` the README's 1P1D with our proxy; ``2p2d`` two prefills and two
decodes behind our proxy, once per ``--policy`` (passed through to ``--policy``); ``pool`` a
prefill and a decode on Mooncake Store (``MooncakeStoreConnector``, proxy ``--mode pool``).

Measures per target: TTFT and TBT (per request, the ``--tbt-quantile`` of its token gaps) SLO
attainment at ``--ttft-slo-ms`` / ``--tbt-slo-ms``, goodput (requests meeting both per second of the
replay); prompt tokens computed (every engine's ``vllm:prompt_tokens_by_source_total{source=
"local_compute"}``) against the bound (tokens in blocks no earlier request had: no system can
compute fewer), and tokens loaded by transfer (``source="external_kv_transfer"``) against the same
bound, the least a decode that keeps its cache must pull. Answers are compared with ``plain``'s
(greedy) when ``plain`` ran in the same invocation.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks import common
from benchmarks.trace_model import (
    Scale,
    Slo,
    TraceRequest,
    attainment,
    conversations,
    load_trace,
    new_tokens,
    prompt_for,
    request_tbt_ms,
)
from harness import servers
from harness.pd import ServerSpec, client_session, kv_args, sse_events, start_many
from harness.tiny_model import build_tiny_model

DEFAULT_TRACE = common.REPO_DIR / "benchmarks" / "traces" / "conversation_slice.jsonl"
TARGETS = ("plain", "pair", "2p2d", "pool")
MAX_MODEL_LEN = 4096  # the tiny model's position limit
VOCAB = 2048  # the tiny model's vocabulary
TE_PORT = 13603
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class Stack:
    """One target's running servers: where to send requests, which engines to read, and every
    process to stop (in reverse)."""

    url: str
    engines: dict[str, servers.VllmServer]  # role name -> server
    started: list = field(default_factory=list)

    def stop(self) -> None:
        for s in reversed(self.started):
            s.stop()


def engine_args(*extra: str) -> list[str]:
    return ["--max-model-len", str(MAX_MODEL_LEN), "--distributed-executor-backend", "uni", *extra]


def start_proxy(args: list[str], log_dir: Path, name: str, started: list) -> str:
    port = servers.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "mooncake_vllm.proxy.server", *args, "--port", str(port),
            "--log-level", "warning"]  # fmt: skip
    proc = servers.ManagedProcess(name, argv, log_dir / f"{name}.log").start()
    started.append(proc)
    proc.wait_until(lambda: servers.http_text(f"{url}/health") is not None, 60, "healthy")
    return url


def start_target(target: str, policy: str, model: str, workdir: Path, log_dir: Path) -> Stack:
    started: list = []
    try:
        if target == "plain":
            (srv,) = start_many(model, [ServerSpec("trace-plain", "127.0.0.1", engine_args())],
                                timeout_s=1200, log_dir=log_dir)  # fmt: skip
            return Stack(srv.url, {"plain": srv}, [srv])
        if target == "pool":
            master = servers.start_mooncake_master(log_dir=log_dir)
            started.append(master)
            extra = {
                "master_server_address": master.address,
                "metadata_server": master.metadata_url,
                "global_segment_size": "512MB",
            }
            kv = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": extra})  # fmt: skip
            pool_args = engine_args("--kv-transfer-config", kv)
            specs = [ServerSpec(f"trace-pool-{n}", "127.0.0.1", pool_args) for n in ("p", "d")]
            p, d = start_many(model, specs, timeout_s=1200, log_dir=log_dir)
            started += [p, d]
            url = start_proxy(["--prefill", p.url, "--decode", d.url, "--mode", "pool"], log_dir,
                              "trace-proxy-pool", started)  # fmt: skip
            return Stack(url, {"prefill0": p, "decode0": d}, started)
        n = 1 if target == "pair" else 2
        config = workdir / "mooncake.json"
        config.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                                      "device_name": ""}))  # fmt: skip
        env = {"MOONCAKE_CONFIG_PATH": str(config)}
        specs = []
        for role, kv_role, key in (("prefill", "kv_producer", "prefill_url"),
                                   ("decode", "kv_consumer", "decode_url")):  # fmt: skip
            for i in range(n):
                host = f"127.0.0.{60 + 2 * i + (role == 'decode')}"
                top: dict[str, Any] = {"engine_id": f"trace-{role}{i}"}
                if role == "decode":
                    top["kv_load_failure_policy"] = "recompute"
                specs.append(ServerSpec(f"trace-{target}-{role}{i}", host, engine_args(
                    *kv_args(kv_role, {key: f"{host}:{TE_PORT}"}, **top)), env))  # fmt: skip
        engines = start_many(model, specs, timeout_s=1200, log_dir=log_dir)
        started += engines
        args = ["--policy", policy] if target == "2p2d" else []
        for i in range(n):
            args += ["--prefill", engines[i].url, "--decode", engines[n + i].url]
        url = start_proxy(args, log_dir, f"trace-proxy-{target}", started)
        names = [f"prefill{i}" for i in range(n)] + [f"decode{i}" for i in range(n)]
        return Stack(url, dict(zip(names, engines, strict=True)), started)
    except BaseException:
        for s in reversed(started):
            s.stop()
        raise


async def one_request(
    http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One streamed, greedy completion: when each token arrived (s after sending) and its ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for event in sse_events(resp):
            for choice in event.get("choices", []):
                got = choice.get("token_ids") or []
                if got:
                    now = time.perf_counter() - t0
                    times += [now] * len(got)
                    ids += got
    if not times:
        raise RuntimeError("no tokens streamed")
    return {"times_s": times, "token_ids": ids}


async def replay(url: str, model: str, trace: list[TraceRequest], scale: Scale, slo: Slo,
                 seed: int, desc: str) -> tuple[list[dict], float]:  # fmt: skip
    """Every request of ``trace``, one client per conversation; samples in trace order and the
    replay's span in seconds."""
    first_ms = min(r.timestamp_ms for r in trace)
    samples: list[dict] = [{} for _ in trace]
    bar = tqdm(total=len(trace), desc=desc, file=sys.stderr)
    async with client_session(total_timeout_s=600) as http:
        t_start = time.perf_counter()

        async def play(group: list[int]) -> None:
            for i in group:
                r = trace[i]
                delay = scale.arrival_s(r, first_ms) - (time.perf_counter() - t_start)
                if delay > 0:
                    await asyncio.sleep(delay)
                sent_s = time.perf_counter() - t_start
                s: dict[str, Any] = {"index": i, "sent_s": sent_s,
                                     "prompt_tokens": scale.input_tokens(r),
                                     "max_tokens": scale.output_tokens(r)}  # fmt: skip
                try:
                    got = await one_request(http, url, model, prompt_for(r, scale, VOCAB, seed),
                                            scale.output_tokens(r))  # fmt: skip
                    s["ttft_ms"] = got["times_s"][0] * 1000
                    s["tbt_ms"] = request_tbt_ms(got["times_s"], slo.tbt_quantile)
                    s["latency_ms"] = got["times_s"][-1] * 1000
                    s["token_ids"] = got["token_ids"]
                except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                    s["error"] = f"{type(e).__name__}: {e}"[:300]
                samples[i] = s
                bar.update()

        await asyncio.gather(*(play(g) for g in conversations(trace)))
        span_s = time.perf_counter() - t_start
    bar.close()
    return samples, span_s


def by_source(stack: Stack) -> dict[str, dict[str, float]]:
    return {name: {s: srv.metric(BY_SOURCE, source=s) for s in SOURCES}
            for name, srv in stack.engines.items()}  # fmt: skip


def requests_done(stack: Stack) -> dict[str, float]:
    return {n: s.metric("vllm:request_success_total") for n, s in stack.engines.items()}


def moved(after: dict, before: dict) -> dict:
    if isinstance(after, dict):
        return {k: moved(v, before.get(k, 0.0 if not isinstance(v, dict) else {}))
                for k, v in after.items()}  # fmt: skip
    return after - before


def run_target(target: str, policy: str, model: str, trace: list[TraceRequest], scale: Scale,
               slo: Slo, seed: int, workdir: Path, log_dir: Path) -> dict:  # fmt: skip
    t0 = time.monotonic()
    stack = start_target(target, policy, model, workdir, log_dir)
    label = f"{target}:{policy}" if target == "2p2d" else target
    print(f"{label}: up in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    try:
        # Warm-up on blocks no trace id maps to (seed + 1): compiles, first connections.
        warm = [TraceRequest(0, 600, 8, (10**9, 10**9 + 1))]
        asyncio.run(replay(stack.url, model, warm, scale, slo, seed + 1, f"{label} warm-up"))
        time.sleep(1.5)  # vLLM publishes its counters about once a second
        before, done_before = by_source(stack), requests_done(stack)
        samples, span_s = asyncio.run(replay(stack.url, model, trace, scale, slo, seed, label))
        time.sleep(2.0)
        sources = moved(by_source(stack), before)
        done = moved(requests_done(stack), done_before)
    finally:
        stack.stop()
    return {"target": label, "span_s": span_s, "samples": samples, "sources": sources,
            "requests_per_engine": done}  # fmt: skip


def summarize(runs: list[dict], bound: int, slo: Slo, plain: dict | None) -> list[dict]:
    """One row per run; answers compared with ``plain``'s run (same trace) when there is one."""
    rows = []
    for run in runs:
        samples = run["samples"]
        ok = [s for s in samples if "error" not in s]
        computed = sum(v["local_compute"] for v in run["sources"].values())
        pulled = sum(v["external_kv_transfer"] for v in run["sources"].values())
        decodes = {k: v for k, v in run["requests_per_engine"].items() if not k.startswith("pre")}
        equal = None
        if plain is not None and run is not plain:
            pairs = [(s, p) for s, p in zip(samples, plain["samples"], strict=True)
                     if "token_ids" in s and "token_ids" in p]  # fmt: skip
            equal = f"{sum(s['token_ids'] == p['token_ids'] for s, p in pairs)}/{len(pairs)}"
        rows.append({
            "target": run["target"],
            "requests": len(samples),
            "errors": len(samples) - len(ok),
            **attainment(samples, slo, run["span_s"]),
            "ttft_p50_ms": common.percentile([s["ttft_ms"] for s in ok], 50),
            "ttft_p90_ms": common.percentile([s["ttft_ms"] for s in ok], 90),
            "tbt_p90_ms": common.percentile([s["tbt_ms"] for s in ok if s["tbt_ms"]], 90),
            "computed_x_bound": computed / bound,
            "pulled_x_least": pulled / bound if pulled else None,
            "computed_tokens": computed,
            "pulled_tokens": pulled,
            "per_engine": "/".join(f"{int(v)}" for v in run["requests_per_engine"].values()),
            "decode_max_share_%": 100 * max(decodes.values()) / max(1.0, sum(decodes.values()))
            if len(decodes) > 1
            else None,
            "equal_to_plain": equal,
            "span_s": run["span_s"],
        })  # fmt: skip
    return rows


def plot(runs: list[dict], rows: list[dict], slo: Slo) -> Callable[[Path], None]:
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for run in runs:
            ttft = sorted(s["ttft_ms"] for s in run["samples"] if "ttft_ms" in s)
            n = len(run["samples"])
            ax1.step(ttft, [100 * (i + 1) / n for i in range(len(ttft))], where="post",
                     label=run["target"])  # fmt: skip
        ax1.axvline(slo.ttft_ms, color="grey", linestyle=":", label="TTFT SLO")
        ax1.set_xscale("log")
        ax1.set_xlabel("TTFT (ms)")
        ax1.set_ylabel("requests at or under (%)")
        ax1.legend(fontsize=8)
        labels = [r["target"] for r in rows]
        ax2.bar(labels, [r["computed_x_bound"] for r in rows], color="#1f77b4")
        ax2.axhline(1.0, color="grey", linestyle=":", label="the trace's bound")
        ax2.set_ylabel("prompt tokens computed / bound")
        ax2.tick_params(axis="x", labelrotation=20)
        ax2.legend(fontsize=8)
        common.save_figure(fig, path, "Mooncake conversation trace replayed (scaled), tiny model")

    return draw


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--targets", default="plain,pair", help=f"comma list of {','.join(TARGETS)}")
    ap.add_argument("--policy", default="prefix",
                    help="2p2d: the proxy's --policy, comma list to run several")  # fmt: skip
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    ap.add_argument("--length-div", type=int, default=4)
    ap.add_argument("--time-mul", type=float, default=0.05)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tbt-slo-ms", type=float, default=100.0)
    ap.add_argument("--tbt-quantile", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-with", type=Path, default=None, metavar="SAMPLES",
                    help="an earlier run's samples file whose plain answers this run's are "
                    "checked against (same trace, scale and seed)")  # fmt: skip
    ap.add_argument("--name", default="trace", help="result directory name (%(default)s)")
    args = ap.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    if bad := [t for t in targets if t not in TARGETS]:
        ap.error(f"--targets: {bad} not in {TARGETS}")
    trace = load_trace(args.trace)[: args.requests]
    scale = Scale(args.length_div, args.time_mul, args.max_output_tokens)
    slo = Slo(args.ttft_slo_ms, args.tbt_slo_ms, args.tbt_quantile)
    bound = sum(new_tokens(trace, scale))
    prompt_tokens = sum(scale.input_tokens(r) for r in trace)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-trace-"))
    log_dir = workdir / "logs"
    log_dir.mkdir()
    model = str(build_tiny_model())
    runs = []
    try:
        for target in targets:
            for policy in args.policy.split(",") if target == "2p2d" else [""]:
                runs.append(run_target(target, policy, model, trace, scale, slo, args.seed,
                                       workdir, log_dir))  # fmt: skip
    finally:
        servers.stop_all()
    plain = next((r for r in runs if r["target"] == "plain"), None)
    plain_from = None
    if plain is None and args.compare_with is not None:
        plain_from = args.compare_with
        earlier = json.loads(args.compare_with.read_text())
        plain = next(r for r in earlier["samples"] if r["target"] == "plain")
        if len(plain["samples"]) != len(trace):
            ap.error(f"--compare-with {args.compare_with}: its plain run has "
                     f"{len(plain['samples'])} requests, this trace {len(trace)}")  # fmt: skip
    rows = summarize(runs, bound, slo, plain)
    settings = {
        "trace": common._display_path(args.trace), "requests": len(trace),
        "conversations": len(conversations(trace)), "length_div": args.length_div,
        "block_tokens": scale.block_tokens, "time_mul": args.time_mul,
        "max_output_tokens": args.max_output_tokens, "ttft_slo_ms": args.ttft_slo_ms,
        "tbt_slo_ms": args.tbt_slo_ms, "tbt_quantile": args.tbt_quantile, "seed": args.seed,
        "prompt_tokens": prompt_tokens, "bound_tokens": bound,
        "bound_share_%": 100 * bound / prompt_tokens, "max_model_len": MAX_MODEL_LEN,
        "log_dir": str(log_dir),
        "answers_compared_with": "this run" if plain in runs else common._display_path(plain_from)
        if plain_from else None,
    }  # fmt: skip
    notes = [
        "bound: prompt tokens in blocks no earlier request had (hash_ids); no system computes "
        "fewer. vLLM recomputes at least a prompt's last token, so a perfect cache reads a "
        "little over 1.00x",
        "computed: every engine's vllm:prompt_tokens_by_source_total{source=local_compute}; "
        "pulled: {source=external_kv_transfer}, against the same bound (a decode keeping its "
        "cache pulls at least the first-seen blocks)",
        "TBT of a request: the tbt_quantile of its gaps between streamed tokens; goodput: "
        "requests meeting both SLOs per second of replay",
        "per_engine: vllm:request_success_total per engine (prefills, then decodes)",
    ]
    paths = common.write_result(args.out_dir, args.name, settings=settings, samples=runs,
                                rows=rows, notes=notes, plot=plot(runs, rows, slo))  # fmt: skip
    common.report(f"trace replay: {len(trace)} requests, bound {bound} of {prompt_tokens} tokens",
                  rows, paths)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
