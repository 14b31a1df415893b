"""Replay of a Mooncake trace, scaled to this box: SLO attainment, goodput, and prompt tokens
computed against the trace's own reuse bound.

    python -m benchmarks.trace [--targets plain,pair,2p2d,pool] [--policy round_robin,prefix,kv]
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
decodes, each publishing its KV events (``--kv-events-config``, ZMQ on an ``ipc://`` socket in
the run's directory), behind one proxy per ``--policy`` (``kv`` subscribes to the four
publishers): the policies replay the trace one after the other on the same engines, every
engine's prefix cache reset (vLLM's ``POST /reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``)
before each, so none inherits another's cache; ``pool`` a prefill and a decode on Mooncake
Store (``MooncakeStoreConnector``, proxy ``--mode pool``).

Measures per target: TTFT and TBT (per request, the ``--tbt-quantile`` of its token gaps) SLO
attainment at ``--ttft-slo-ms`` / ``--tbt-slo-ms``, goodput (requests meeting both per second of the
replay); prompt tokens computed (every engine's ``vllm:prompt_tokens_by_source_total{source=
"local_compute"}``) against the bound (tokens in blocks no earlier request had: no system can
compute fewer), and tokens loaded by transfer (``source="external_kv_transfer"``) against the same
bound, the least a decode that keeps its cache must pull. Answers are compared with ``plain``'s
(greedy) when ``plain`` ran in the same invocation (or ``--compare-with``'s).

Per request, the proxy's log tells which prefill and decode served it (the replay names each
request ``X-Request-Id: trace-<policy>-<index>``); from those choices, per pool, the share of
the busiest engine and the routing regret (``trace_model.routing_regret``: prompt tokens another
engine held beyond the chosen one's, i.e. recompute or pull the choice added).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
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
    routing_regret,
)
from harness import servers
from harness.pd import ServerSpec, client_session, kv_args, sse_events, start_many
from harness.router import ROUTER_ENV, pd_args, router_binary, start_router
from harness.tiny_model import build_tiny_model

DEFAULT_TRACE = common.REPO_DIR / "benchmarks" / "traces" / "conversation_slice.jsonl"
TARGETS = ("plain", "pair", "2p2d", "pool")
# 2p2d's front ends, in the order they replay: our proxy's --policy, and vLLM's router
# (``make bench-trace-routing`` installs it) with its cache_aware policy on both legs, and with
# kv_aware prefills on the prefills' KV events.
OURS = ("round_robin", "prefix", "kv")
ROUTER_POLICIES = ("router_cache_aware", "router_kv_aware")
POLICIES = (*OURS, *ROUTER_POLICIES)
MAX_MODEL_LEN = 4096  # the tiny model's position limit
VOCAB = 2048  # the tiny model's vocabulary
TE_PORT = 13603
BOOTSTRAP_PORT = 8998  # our connector's default, each prefill on its own address
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class Stack:
    """One target's running servers: where to send requests (a proxy per 2p2d policy), which
    engines to read, and every process to stop (in reverse)."""

    proxies: dict[str, str]  # policy ("" outside 2p2d) -> the URL requests go to
    engines: dict[str, servers.VllmServer]  # role name -> server
    started: list = field(default_factory=list)
    proxy_logs: dict[str, Path] = field(default_factory=dict)  # policy -> its proxy's log

    def stop(self) -> None:
        for s in reversed(self.started):
            s.stop()


def engine_args(*extra: str) -> list[str]:
    return ["--max-model-len", str(MAX_MODEL_LEN), "--distributed-executor-backend", "uni", *extra]


def start_proxy(args: list[str], log_dir: Path, name: str, started: list) -> str:
    port = servers.free_port()
    url = f"http://127.0.0.1:{port}"
    # info: one line per leg names the backend that served it (``choices``).
    argv = [sys.executable, "-m", "mooncake_vllm.proxy.server", *args, "--port", str(port),
            "--log-level", "info"]  # fmt: skip
    proc = servers.ManagedProcess(name, argv, log_dir / f"{name}.log").start()
    started.append(proc)
    proc.wait_until(lambda: servers.http_text(f"{url}/health") is not None, 60, "healthy")
    return url


def start_target(target: str, policies: list[str], model: str, workdir: Path,
                 log_dir: Path) -> Stack:  # fmt: skip
    started: list = []
    try:
        if target == "plain":
            (srv,) = start_many(model, [ServerSpec("trace-plain", "127.0.0.1", engine_args())],
                                timeout_s=1200, log_dir=log_dir)  # fmt: skip
            return Stack({"": srv.url}, {"plain": srv}, [srv])
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
            return Stack({"": url}, {"prefill0": p, "decode0": d}, started,
                         {"": log_dir / "trace-proxy-pool.log"})  # fmt: skip
        n = 1 if target == "pair" else 2
        config = workdir / "mooncake.json"
        config.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                                      "device_name": ""}))  # fmt: skip
        env = {"MOONCAKE_CONFIG_PATH": str(config)}
        if target == "2p2d":
            env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache between policies
        names = [f"prefill{i}" for i in range(n)] + [f"decode{i}" for i in range(n)]
        # vLLM binds its publisher only for tcp://*, ipc:// and inproc:// (a tcp://HOST:PORT
        # endpoint it connects to): a socket file of this run's, reachable from this host only.
        events = {name: f"ipc://{workdir}/kv-events-{name}.sock" for name in names}
        specs = []
        for role, kv_role, key in (("prefill", "kv_producer", "prefill_url"),
                                   ("decode", "kv_consumer", "decode_url")):  # fmt: skip
            for i in range(n):
                host = f"127.0.0.{60 + 2 * i + (role == 'decode')}"
                top: dict[str, Any] = {"engine_id": f"trace-{role}{i}"}
                if role == "decode":
                    top["kv_load_failure_policy"] = "recompute"
                args = engine_args(*kv_args(kv_role, {key: f"{host}:{TE_PORT}"}, **top))
                if target == "2p2d":
                    args += ["--kv-events-config", json.dumps({
                        "enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": events[f"{role}{i}"]})]  # fmt: skip
                specs.append(ServerSpec(f"trace-{target}-{role}{i}", host, args, env))
        engines = start_many(model, specs, timeout_s=1200, log_dir=log_dir)
        started += engines
        by_name = dict(zip(names, engines, strict=True))
        stack = Stack({}, by_name, started)
        for policy in policies if target == "2p2d" else [""]:
            if policy in ROUTER_POLICIES:
                stack.proxies[policy] = start_vllm_router(policy, engines[:n], engines[n:],
                                                          events, log_dir, started)  # fmt: skip
                continue
            args = ["--policy", policy] if policy else []
            for i in range(n):
                args += ["--prefill", engines[i].url, "--decode", engines[n + i].url]
            if policy == "kv":
                args += [f"--kv-events={srv.url}={events[name]}" for name, srv in by_name.items()]
            name = f"trace-proxy-{target}" + (f"-{policy}" if policy else "")
            stack.proxies[policy] = start_proxy(args, log_dir, name, started)
            stack.proxy_logs[policy] = log_dir / f"{name}.log"
        return stack
    except BaseException:
        for s in reversed(started):
            s.stop()
        raise


def start_vllm_router(policy: str, prefills: list, decodes: list, events: dict[str, str],
                      log_dir: Path, started: list) -> str:  # fmt: skip
    """vLLM's router in its ``mooncake`` P/D mode over the same engines: ``cache_aware`` on both
    legs (its defaults), or ``kv_aware`` prefills subscribed to the prefills' KV events
    (``--pd-kv-events``) with ``kv_aware`` decodes (which see no events: load only)."""
    args = pd_args([(p.url, BOOTSTRAP_PORT) for p in prefills], [d.url for d in decodes],
                   "mooncake")  # fmt: skip
    if policy == "router_cache_aware":
        args += ["--policy", "cache_aware"]
    else:
        args += ["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware"]
        args += [f"--pd-kv-events={p.url}={events[f'prefill{i}']}" for i, p in enumerate(prefills)]
    router = start_router(args, name=f"trace-{policy}", log_dir=log_dir, timeout_s=120)
    started.append(router)
    return router.url


async def one_request(
    http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
    request_id: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One streamed, greedy completion: when each token arrived (s after sending) and its ids.
    ``request_id`` goes out as ``X-Request-Id`` (the replay reads each leg's choice by it)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    headers = {"X-Request-Id": request_id} if request_id else {}
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
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
                 seed: int, desc: str, id_prefix: str,
                 at_a_time: int = 0) -> tuple[list[dict], float]:  # fmt: skip
    """Every request of ``trace``; samples in trace order and the replay's span in seconds.
    Request ``i`` is sent as ``X-Request-Id: <id_prefix><i>``. ``at_a_time`` 0: one client per
    conversation, each turn at its scaled arrival time; N > 0: N clients, each playing the next
    whole conversation (in order of first arrival), every turn as soon as the last is answered."""
    first_ms = min(r.timestamp_ms for r in trace)
    samples: list[dict] = [{} for _ in trace]
    bar = tqdm(total=len(trace), desc=desc, file=sys.stderr)
    async with client_session(total_timeout_s=600) as http:
        t_start = time.perf_counter()

        async def play(group: list[int]) -> None:
            for i in group:
                r = trace[i]
                delay = scale.arrival_s(r, first_ms) - (time.perf_counter() - t_start)
                if delay > 0 and not at_a_time:
                    await asyncio.sleep(delay)
                sent_s = time.perf_counter() - t_start
                s: dict[str, Any] = {"index": i, "sent_s": sent_s,
                                     "prompt_tokens": scale.input_tokens(r),
                                     "max_tokens": scale.output_tokens(r)}  # fmt: skip
                try:
                    got = await one_request(http, url, model, prompt_for(r, scale, VOCAB, seed),
                                            scale.output_tokens(r), f"{id_prefix}{i}")  # fmt: skip
                    s["ttft_ms"] = got["times_s"][0] * 1000
                    s["tbt_ms"] = request_tbt_ms(got["times_s"], slo.tbt_quantile)
                    s["latency_ms"] = got["times_s"][-1] * 1000
                    s["token_ids"] = got["token_ids"]
                except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                    s["error"] = f"{type(e).__name__}: {e}"[:300]
                samples[i] = s
                bar.update()

        groups = conversations(trace)
        if at_a_time:
            queue = sorted(groups, key=lambda g: trace[g[0]].timestamp_ms)

            async def client() -> None:
                while queue:
                    await play(queue.pop(0))

            await asyncio.gather(*(client() for _ in range(min(at_a_time, len(queue)))))
        else:
            await asyncio.gather(*(play(g) for g in groups))
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


def reset_caches(stack: Stack, timeout_s: float = 60.0) -> None:
    """Empty every engine's prefix cache (its publisher sends AllBlocksCleared). vLLM refuses
    while blocks are held (a lease not yet released), so each is retried until it agrees."""
    for name, srv in stack.engines.items():
        deadline = time.monotonic() + timeout_s
        while not servers.http_json(f"{srv.url}/reset_prefix_cache", {}).get("success"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: prefix cache not reset in {timeout_s:.0f}s")
            time.sleep(0.5)


LEG_LINE = re.compile(r" (\S+) (prefill|decode) (http://\S+) -> \d+$")


def choices(log: Path, id_prefix: str, urls: dict[str, str]) -> dict[int, dict[str, str]]:
    """Per request index, the engine (by name) each leg was sent to, from the proxy's log (the
    last leg of each role wins: a retried leg's answer is the one that served)."""
    out: dict[int, dict[str, str]] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = LEG_LINE.search(line)
        if m and m[1].startswith(id_prefix) and m[1][len(id_prefix) :].isdigit():
            out.setdefault(int(m[1][len(id_prefix) :]), {})[m[2]] = urls.get(m[3], m[3])
    return out


def run_target(target: str, policies: list[str], model: str, trace: list[TraceRequest],
               scale: Scale, slo: Slo, seed: int, workdir: Path, log_dir: Path,
               at_a_time: Sequence[int] = (0,)) -> list[dict]:  # fmt: skip
    """One run per proxy of ``target`` and per ``at_a_time`` (2p2d: per policy, on the same
    engines, each after a reset of every engine's prefix cache)."""
    t0 = time.monotonic()
    stack = start_target(target, policies, model, workdir, log_dir)
    labels = {p: f"{target}:{p}" if p else target for p in stack.proxies}
    print(f"{target}: up in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    runs = []
    try:
        # Warm-up on blocks no trace id maps to (seed + 1): compiles, first connections.
        warm = [TraceRequest(0, 600, 8, (10**9, 10**9 + 1))]
        for policy, url in stack.proxies.items():
            asyncio.run(replay(url, model, warm, scale, slo, seed + 1, f"{labels[policy]} warm-up",
                               f"warm-{policy}-"))  # fmt: skip
        # plain answers the same at any concurrency (greedy): once is enough to compare with.
        for n in at_a_time[:1] if target == "plain" else at_a_time:
            for policy, url in stack.proxies.items():
                if target == "2p2d":
                    reset_caches(stack)
                time.sleep(1.5)  # vLLM publishes its counters about once a second
                before, done_before = by_source(stack), requests_done(stack)
                label = labels[policy] + (f" x{n}" if n else "")
                prefix = f"trace-{policy}-{n}-"
                samples, span_s = asyncio.run(replay(url, model, trace, scale, slo, seed, label,
                                                     prefix, n))  # fmt: skip
                time.sleep(2.0)
                sources = moved(by_source(stack), before)
                done = moved(requests_done(stack), done_before)
                runs.append({"target": label, "span_s": span_s, "samples": samples,
                             "sources": sources, "requests_per_engine": done,
                             "policy": policy, "id_prefix": prefix,
                             "conversations_at_a_time": n})  # fmt: skip
    finally:
        stack.stop()
    urls = {srv.url: name for name, srv in stack.engines.items()}
    for run in runs:
        log = stack.proxy_logs.get(run["policy"])
        if log is not None and log.exists():
            for i, legs in choices(log, run["id_prefix"], urls).items():
                run["samples"][i].update(legs)
    return runs


def pool_stats(samples: list[dict], trace: list[TraceRequest], scale: Scale, role: str) -> dict:
    """For one pool (``role``), from the per-request choices: the routing regret
    (``routing_regret``) in tokens and in requests; {} when no choice is known."""
    chosen = [s.get(role) for s in samples]
    if all(c is None for c in chosen):
        return {}
    order = sorted(range(len(samples)), key=lambda i: samples[i].get("sent_s", 0.0))
    regret = routing_regret([trace[i] for i in order], [chosen[i] for i in order], scale)
    return {
        f"{role}_regret_tokens": sum(regret),
        f"{role}_regret_requests": sum(1 for r in regret if r),
    }


def summarize(runs: list[dict], bound: int, slo: Slo, plain: dict | None,
              trace: list[TraceRequest], scale: Scale) -> list[dict]:  # fmt: skip
    """One row per run; answers compared with ``plain``'s run (same trace) when there is one."""
    rows = []
    for run in runs:
        samples = run["samples"]
        ok = [s for s in samples if "error" not in s]
        computed = sum(v["local_compute"] for v in run["sources"].values())
        pulled = sum(v["external_kv_transfer"] for v in run["sources"].values())
        per_engine = run["requests_per_engine"]
        shares = {}
        for role in ("prefill", "decode"):
            pool = [v for k, v in per_engine.items() if k.startswith(role)]
            if len(pool) > 1:
                shares[f"{role}_max_share_%"] = 100 * max(pool) / max(1.0, sum(pool))
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
            "ttft_p99_ms": common.percentile([s["ttft_ms"] for s in ok], 99),
            "tbt_p90_ms": common.percentile([s["tbt_ms"] for s in ok if s["tbt_ms"]], 90),
            "computed_x_bound": computed / bound,
            "pulled_x_least": pulled / bound if pulled else None,
            "computed_tokens": computed,
            "pulled_tokens": pulled,
            "per_engine": "/".join(f"{int(v)}" for v in run["requests_per_engine"].values()),
            **shares,
            **pool_stats(samples, trace, scale, "prefill"),
            **pool_stats(samples, trace, scale, "decode"),
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
    ap.add_argument("--policy", default=",".join(POLICIES),
                    help="2p2d: the proxies' --policy, comma list, replayed in this order on "
                    "the same engines (%(default)s)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    ap.add_argument("--conversations", default="0",
                    help="comma list of conversations at a time, each replayed in turn: 0 "
                    "follows the trace's arrival times (every conversation its own client); N "
                    "keeps N conversations going, each turn sent when the last is answered "
                    "(%(default)s)")  # fmt: skip
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
    policies = [p for p in args.policy.split(",") if p]
    if bad := [p for p in policies if p not in POLICIES]:
        ap.error(f"--policy: {bad} not in {POLICIES}")
    at_a_time = [int(n) for n in args.conversations.split(",") if n]
    if any(n < 0 for n in at_a_time) or not at_a_time:
        ap.error("--conversations: a comma list of counts >= 0")
    if any(p in ROUTER_POLICIES for p in policies) and router_binary() is None:
        ap.error(f"--policy {args.policy}: {ROUTER_ENV} names no vllm-router "
                 "(make bench-trace-routing installs it)")  # fmt: skip
    runs = []
    try:
        for target in targets:
            runs += run_target(target, policies, model, trace, scale, slo, args.seed, workdir,
                               log_dir, at_a_time)  # fmt: skip
    finally:
        servers.stop_all()
    plain = next((r for r in runs if r["target"].split(" ")[0] == "plain"), None)
    plain_from = None
    if plain is None and args.compare_with is not None:
        plain_from = args.compare_with
        earlier = json.loads(args.compare_with.read_text())
        plain = next(r for r in earlier["samples"] if r["target"].split(" ")[0] == "plain")
        if len(plain["samples"]) != len(trace):
            ap.error(f"--compare-with {args.compare_with}: its plain run has "
                     f"{len(plain['samples'])} requests, this trace {len(trace)}")  # fmt: skip
    rows = summarize(runs, bound, slo, plain, trace, scale)
    settings = {
        "trace": common._display_path(args.trace), "requests": len(trace),
        "conversations": len(conversations(trace)), "length_div": args.length_div,
        "block_tokens": scale.block_tokens, "time_mul": args.time_mul,
        "max_output_tokens": args.max_output_tokens, "conversations_at_a_time": at_a_time,
        "ttft_slo_ms": args.ttft_slo_ms,
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
        "2p2d: one set of engines; every engine's prefix cache reset before each policy",
        "<pool>_max_share_%: the busiest engine's share of its pool's requests "
        "(vllm:request_success_total); <pool>_regret: from the proxy's log, prompt tokens "
        "(and requests) where another engine of the pool held more of the prompt than the "
        "chosen one (no eviction assumed; trace_model.routing_regret)",
    ]
    paths = common.write_result(args.out_dir, args.name, settings=settings, samples=runs,
                                rows=rows, notes=notes, plot=plot(runs, rows, slo))  # fmt: skip
    common.report(f"trace replay: {len(trace)} requests, bound {bound} of {prompt_tokens} tokens",
                  rows, paths)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
