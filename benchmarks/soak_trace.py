"""Soak: the conversation trace replayed in a loop for an hour at steady load on the README's pair,
every process of the stack sampled each minute: do memory, fds, threads, sockets and held leases
stay flat?

    make soak [SOAK_MINUTES=60]
    python -m benchmarks.soak_trace [--minutes 60] [--sample-s 60] [--warmup-s 300]
        [--check-every 10] [--time-mul 0.05] [--out-dir artifacts/bench]

The stack: the README's pair on 127.0.0.1 (a ``kv_producer`` and a ``kv_consumer`` with
``MooncakeConnector``, one mooncake.json, P2P handshake over TCP, vLLM's default ``fail`` policy),
``proxy/proxy_server.py`` in front of it, and a plain vLLM (vLLM's uni executor, see
``harness.pd.reference_spec``) that only answers what the pair must equal.

The load: ``benchmarks.trace``'s slice of whole conversations, scaled the same way (lengths ÷ 4,
time × ``--time-mul``, outputs ≤ 32 tokens, greedy, ``ignore_eos``), replayed as loop after loop:
loop k's requests arrive at k × (the scaled trace span + ``--loop-gap-s``) plus their own scaled
arrival, each conversation a client that sends a turn once the previous one is answered. Loops
may overlap, so the load does not sag at a loop's end. Each loop has fresh token content of the
same shape (``soak_model.loop_seed``): its prefix-cache hits are the trace's own reuse, not the
previous loop's blocks. No request is sent after ``--minutes``.

Checks: every answer of loop 0, and each ``--check-every``-th of later loops, is asked of the plain
vLLM too and compared token by token; the decode's counters must show 0 pull failures and prompt
tokens loaded by transfer. Exit status 1 on any failed request, differing answer or failed pull.

Sampled every ``--sample-s`` seconds for every process of each server's process group (vLLM's API
server, engine core and its children; the proxy; the plain vLLM), with psutil: RSS, open fds,
threads, established TCP sockets (``tcp``: the transfer engine's handshake and data connections
and the side channel live in the engine core; the engine has no call that counts its open
segments and P2P handshake has no metadata store to list, so its sockets are what shows a segment
or connection opened per peer or per request and never closed). Stack-wide: the prefill's
``mooncake_vllm:held_leases``, the decode's KV cache usage, pulls per minute and failed pulls.
Each series after ``--warmup-s`` gets a least-squares slope per hour and its noise (the residuals'
standard deviation); ``flat``: the line moved at most 3 × its noise over the span (or two units
of a count, 1 % of the mean RSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from tqdm import tqdm

from benchmarks import common, tables
from benchmarks.soak_model import (
    METRICS,
    checked_against_plain,
    flat_floor,
    loop_seed,
    process_label,
    series,
    trend,
    unique_labels,
)
from benchmarks.trace import BY_SOURCE, DEFAULT_TRACE, MAX_MODEL_LEN, SOURCES, VOCAB, one_request
from benchmarks.trace_model import Scale, TraceRequest, conversations, load_trace, prompt_for
from harness import servers
from harness.pd import client_session, readme_pair, reference_spec, start_many
from harness.tiny_model import build_tiny_model
from harness.xpyd import start_pair_proxy

NAME = "soak_trace"


@dataclasses.dataclass
class Stack:
    prefill: servers.VllmServer
    decode: servers.VllmServer
    plain: servers.VllmServer
    proxy: Any  # harness.xpyd.ProxyServer

    def groups(self) -> dict[str, servers.ManagedProcess]:
        return {"prefill": self.prefill.process, "decode": self.decode.process,
                "proxy": self.proxy.process, "plain": self.plain.process}  # fmt: skip

    def stop(self) -> None:
        for s in (self.proxy, self.decode, self.prefill, self.plain):
            s.stop()


def start_stack(model: str, workdir: Path, log_dir: Path) -> Stack:
    long = {"max_model_len": MAX_MODEL_LEN}  # the trace's longest turns need 4096 positions
    pair = readme_pair(workdir / "mooncake.json", "soak", "127.0.0.1")
    specs = [dataclasses.replace(s, **long) for s in (*pair, reference_spec("plain-soak"))]
    prefill, decode, plain = start_many(model, specs, timeout_s=1200, log_dir=log_dir)
    try:
        proxy = start_pair_proxy(prefill.url, decode.url)
    except BaseException:
        for s in (decode, prefill, plain):
            s.stop()
        raise
    return Stack(prefill, decode, plain, proxy)


# ---- sampling -----------------------------------------------------------------------------------


def read_process(proc: psutil.Process) -> dict[str, float]:
    with proc.oneshot():
        conns = proc.net_connections(kind="tcp")
        return {
            "rss_mib": round(proc.memory_info().rss / 2**20, 2),
            "fds": proc.num_fds(),
            "threads": proc.num_threads(),
            "tcp": sum(c.status == psutil.CONN_ESTABLISHED for c in conns),
        }


def read_group(role: str, group: servers.ManagedProcess) -> dict[str, dict[str, float]]:
    """Every live process of ``group``, by label (``process_label``), in pid order."""
    found = []
    for pid in sorted(group.group_pids()):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p = psutil.Process(pid)
            found.append((process_label(role, p.name(), p.cmdline()), read_process(p)))
    labels = unique_labels(label for label, _ in found)
    return {label: values for label, (_, values) in zip(labels, found, strict=True)}


class Sampler:
    """Every ``every_s`` seconds (and once at start and at stop), one reading of the stack: a
    thread, so that a slow ``/metrics`` never holds up the client's event loop."""

    def __init__(self, stack: Stack, every_s: float) -> None:
        self.stack, self.every_s = stack, every_s
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._last_pulls: tuple[float, float] | None = None  # (t_s, pulls)

    def sample(self) -> None:
        t_s = time.monotonic() - self._t0
        procs: dict[str, dict[str, float]] = {}
        for role, group in self.stack.groups().items():
            procs.update(read_group(role, group))
        engine: dict[str, dict[str, float | None]] = {}
        try:
            held = self.stack.prefill.metrics(["mooncake_vllm:held_leases"])
            names = ["vllm:kv_cache_usage_perc", "mooncake_vllm:pulls_total",
                     "mooncake_vllm:pull_failures_total"]  # fmt: skip
            dec = self.stack.decode.metrics(names)
        except OSError as e:  # an unanswered /metrics is recorded, not fatal
            self.errors.append(f"{t_s:.0f}s: {type(e).__name__}: {e}")
        else:
            pulls = dec.get("mooncake_vllm:pulls_total", 0.0)
            per_min = None
            if self._last_pulls is not None and t_s > self._last_pulls[0]:
                t_prev, prev = self._last_pulls
                per_min = round(60 * (pulls - prev) / (t_s - t_prev), 2)
            self._last_pulls = (t_s, pulls)
            engine = {
                "prefill": {"held_leases": held.get("mooncake_vllm:held_leases", 0.0)},
                "decode": {
                    "kv_usage_%": round(100 * dec.get("vllm:kv_cache_usage_perc", 0.0), 2),
                    "pulls": pulls,
                    "pulls_per_min": per_min,
                    "pull_failures": dec.get("mooncake_vllm:pull_failures_total", 0.0),
                },
            }
        self.samples.append({"t_s": round(t_s, 1), "procs": procs, "engine": engine})

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> Sampler:
        self._t0 = time.monotonic()
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# ---- load ---------------------------------------------------------------------------------------


async def soak(stack: Stack, model: str, trace: list[TraceRequest], scale: Scale,
               duration_s: float, loop_gap_s: float, check_every: int,
               seed: int) -> list[dict[str, Any]]:  # fmt: skip
    """Loops of ``trace`` for ``duration_s``: one record per request sent, in send order."""
    first_ms = min(r.timestamp_ms for r in trace)
    period_s = max(scale.arrival_s(r, first_ms) for r in trace) + loop_gap_s
    loops = max(1, math.ceil(duration_s / period_s))

    def at_s(loop: int, r: TraceRequest) -> float:
        return loop * period_s + scale.arrival_s(r, first_ms)

    planned = sum(at_s(k, r) < duration_s for k in range(loops) for r in trace)
    records: list[dict[str, Any]] = []
    bar = tqdm(total=planned, desc="soak requests", file=sys.stderr)
    async with client_session(total_timeout_s=600) as http:
        t0 = time.perf_counter()

        async def play(loop: int, group: list[int]) -> None:
            salt = loop_seed(seed, loop)
            for i in group:
                r = trace[i]
                if at_s(loop, r) >= duration_s:
                    return  # the soak is over: the rest of this conversation is not sent
                delay = at_s(loop, r) - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                prompt = prompt_for(r, scale, VOCAB, salt)
                rec: dict[str, Any] = {"loop": loop, "index": i,
                                       "sent_s": round(time.perf_counter() - t0, 3),
                                       "prompt_tokens": len(prompt)}  # fmt: skip
                checked = checked_against_plain(loop, i, check_every)
                try:
                    got = await one_request(http, stack.proxy.url, model, prompt,
                                            scale.output_tokens(r))  # fmt: skip
                    rec["ttft_ms"] = round(got["times_s"][0] * 1000, 1)
                    rec["latency_ms"] = round(got["times_s"][-1] * 1000, 1)
                    if checked:
                        ref = await one_request(http, stack.plain.url, model, prompt,
                                                scale.output_tokens(r))  # fmt: skip
                        rec["equal"] = got["token_ids"] == ref["token_ids"]
                except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                records.append(rec)
                bar.update()

        await asyncio.gather(*(play(k, g) for k in range(loops) for g in conversations(trace)))
    bar.close()
    return records


def warm_up(stack: Stack, model: str, scale: Scale, seed: int) -> None:
    """One request through the pair and one to plain, on blocks no loop uses: compiles, first
    connections, the first pull's handshake."""
    warm = TraceRequest(0, 600, 8, (10**9, 10**9 + 1))
    prompt = prompt_for(warm, scale, VOCAB, seed + 1)

    async def both() -> None:
        async with client_session(total_timeout_s=600) as http:
            for url in (stack.proxy.url, stack.plain.url):
                await one_request(http, url, model, prompt, 8)

    asyncio.run(both())


# ---- results ------------------------------------------------------------------------------------


def decode_sources(decode: servers.VllmServer) -> dict[str, float]:
    """The decode's prompt tokens so far by where vLLM got them: ``local_compute``,
    ``local_cache_hit`` (its own prefix cache: a later turn's history) and
    ``external_kv_transfer`` (pulled from the prefill)."""
    return {src: decode.metric(BY_SOURCE, source=src) for src in SOURCES}


def request_row(records: list[dict[str, Any]], counters: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in records if "error" not in r]
    checked = [r for r in records if "equal" in r]
    ttft = [r["ttft_ms"] for r in ok]
    prompt_tokens = sum(r["prompt_tokens"] for r in records)
    return {
        "table": "requests",
        "loops": len({r["loop"] for r in records}),
        "requests": len(records),
        "failed": len(records) - len(ok),
        "checked": len(checked),
        "differed": sum(not r["equal"] for r in checked),
        "pulls": int(counters["pulls"]),
        "pull_failures": int(counters["pull_failures"]),
        **{f"decode_{short}_%": round(100 * counters[src] / prompt_tokens, 1)
           if prompt_tokens else None
           for short, src in (("pulled", "external_kv_transfer"),
                              ("cache_hit", "local_cache_hit"),
                              ("computed", "local_compute"))},
        "ttft_p50_ms": round(common.percentile(ttft, 50), 1),
        "ttft_p99_ms": round(common.percentile(ttft, 99), 1),
        "rps": round(len(records) / counters["wall_s"], 3),
    }  # fmt: skip


def trend_rows(samples: list[dict[str, Any]], warmup_s: float) -> list[dict[str, Any]]:
    rows = []
    for (metric, proc), points in sorted(series(samples).items()):
        if metric not in METRICS:
            continue  # cumulative counters: their rate is the series
        t = trend(points, warmup_s)
        if t is None:
            continue
        rows.append({
            "table": "after the warm-up: least-squares slope and noise per series",
            "metric": metric, "process": proc, "unit": METRICS[metric][0], "points": t.points,
            "mean": round(t.mean, 2), "first": round(t.first, 2), "last": round(t.last, 2),
            "slope_per_h": round(t.slope_per_h, 3), "noise": round(t.noise, 3),
            "flat": "yes" if t.flat(flat_floor(metric, t.mean)) else "NO",
        })  # fmt: skip
    return rows


def write_series(path: Path, samples: list[dict[str, Any]]) -> Path:
    """The stack's samples by series, one line each (``"metric|process": [[t_s, value], ...]``):
    small enough to commit beside the summary (an hour at one sample a minute is ~60 KB), so the
    published plot can be redrawn and refitted; the per-request records go to the samples file."""
    lines = [f"{json.dumps(f'{m}|{p}')}: {json.dumps(points)}"
             for (m, p), points in sorted(series(samples).items())]  # fmt: skip
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return path


def plot(samples: list[dict[str, Any]], warmup_s: float, title: str):
    """One panel per metric, one line per process, a process the same colour in every panel; RSS
    as the change since the first sample after the warm-up (a leak is a rise, whatever the
    process's size)."""

    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        by = series(samples)
        panels = [m for m in METRICS if any(k[0] == m for k in by)]
        procs = sorted({p for _, p in by})
        colours = plt.get_cmap("tab20")
        colour = {p: colours(i % 20) for i, p in enumerate(procs)}
        n_rows = math.ceil((len(panels) + 1) / 2)  # one more: the legend
        fig, axes = plt.subplots(n_rows, 2, figsize=(12, 2.6 * n_rows), squeeze=False)
        for ax, metric in zip(axes.flat, panels, strict=False):
            for (m, proc), points in sorted(by.items()):
                if m != metric:
                    continue
                ys = [v for _, v in points]
                if metric == "rss_mib":
                    base = next((v for t, v in points if t >= warmup_s), ys[-1])
                    ys = [v - base for v in ys]
                ax.plot([t / 60 for t, _ in points], ys, marker=".", markersize=3, linewidth=1,
                        color=colour[proc], label=proc)  # fmt: skip
            ax.axvline(warmup_s / 60, color="grey", linestyle=":", linewidth=1)
            label = "rss_mib: change since the warm-up" if metric == "rss_mib" else metric
            ax.set_title(f"{label} ({METRICS[metric][0]})", fontsize=9)
            ax.set_xlabel("minutes (dotted: end of warm-up)", fontsize=7)
            ax.tick_params(labelsize=7)
        rest = list(axes.flat)[len(panels) :]
        for ax in rest:
            ax.axis("off")
        handles = [plt.Line2D([], [], color=colour[p], marker=".", label=p) for p in procs]
        rest[0].legend(handles=handles, loc="center", ncol=3, fontsize=7, frameon=False)
        common.save_figure(fig, path, title)

    return draw


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="how long requests are sent")
    ap.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--warmup-s", type=float, default=300.0,
                    help="samples before this are left out of the slopes")  # fmt: skip
    ap.add_argument("--check-every", type=int, default=10,
                    help="after loop 0, every Nth answer is compared with plain's")  # fmt: skip
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--length-div", type=int, default=4)
    ap.add_argument("--time-mul", type=float, default=0.05)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--loop-gap-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=NAME, help="result directory name (%(default)s)")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.sample_s <= 0:
        ap.error("--minutes and --sample-s must be positive")
    trace = load_trace(args.trace)
    scale = Scale(args.length_div, args.time_mul, args.max_output_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-soak-trace-"))
    log_dir = workdir / "logs"
    model = str(build_tiny_model())
    print(f"starting the pair, the proxy and plain vLLM (logs in {log_dir})", file=sys.stderr)
    stack = start_stack(model, workdir, log_dir)
    try:
        warm_up(stack, model, scale, args.seed)
        time.sleep(1.5)  # vLLM publishes its counters about once a second
        pulls0 = stack.decode.metrics(["mooncake_vllm:pulls_total",
                                       "mooncake_vllm:pull_failures_total"])  # fmt: skip
        sources0 = decode_sources(stack.decode)
        t0 = time.monotonic()
        with Sampler(stack, args.sample_s) as sampler:
            records = asyncio.run(soak(stack, model, trace, scale, 60 * args.minutes,
                                       args.loop_gap_s, args.check_every, args.seed))  # fmt: skip
            wall_s = time.monotonic() - t0
            time.sleep(2.0)  # the last steps' counters reach /metrics
        pulls1 = stack.decode.metrics(["mooncake_vllm:pulls_total",
                                       "mooncake_vllm:pull_failures_total"])  # fmt: skip
        counters = {
            "pulls": pulls1.get("mooncake_vllm:pulls_total", 0.0)
            - pulls0.get("mooncake_vllm:pulls_total", 0.0),
            "pull_failures": pulls1.get("mooncake_vllm:pull_failures_total", 0.0)
            - pulls0.get("mooncake_vllm:pull_failures_total", 0.0),
            **{k: v - sources0[k] for k, v in decode_sources(stack.decode).items()},
            "wall_s": wall_s,
        }
    finally:
        stack.stop()
        servers.stop_all()
    samples = sampler.samples
    rows = [request_row(records, counters), *trend_rows(samples, args.warmup_s)]
    first_ms = min(r.timestamp_ms for r in trace)
    settings = {
        "minutes": args.minutes, "sample_s": args.sample_s, "warmup_s": args.warmup_s,
        "check_every": args.check_every, "trace": common._display_path(args.trace),
        "trace_requests": len(trace), "length_div": args.length_div, "time_mul": args.time_mul,
        "max_output_tokens": args.max_output_tokens, "loop_gap_s": args.loop_gap_s,
        "loop_period_s": round(max(scale.arrival_s(r, first_ms) for r in trace)
                               + args.loop_gap_s, 1),
        "seed": args.seed, "wall_s": round(wall_s, 1), "log_dir": str(log_dir),
        "sampler_errors": sampler.errors[:20],
        "request_errors": sorted({r["error"] for r in records if "error" in r})[:20],
    }  # fmt: skip
    notes = [
        "the README's pair on 127.0.0.1 (MooncakeConnector, P2P handshake, TCP, default fail "
        "policy) behind proxy/proxy_server.py; plain vLLM (uni executor) answers the checks",
        f"each loop: the trace's shapes with fresh token content (loop_seed); loop 0 and every "
        f"{args.check_every}th answer after it compared token by token with plain's",
        "per process (psutil): rss_mib, fds, threads, tcp = established TCP sockets; "
        "from /metrics: the prefill's held_leases, the decode's kv_usage_%, pulls_per_min and "
        "pull_failures; decode_*_%: its prompt tokens by source over the prompt tokens sent",
        f"slope and noise (residual std) over samples at or after {args.warmup_s:g} s; flat: "
        "|slope × span| ≤ 3 × noise, or ≤ 2 for counts, ≤ 1 % of the mean for RSS",
    ]
    title = (
        f"soak: {args.minutes:g} min of trace loops on the pair, sampled every {args.sample_s:g} s"
    )
    paths = common.write_result(args.out_dir, args.name, settings=settings, samples=records,
                                rows=rows, notes=notes,
                                plot=plot(samples, args.warmup_s, title))  # fmt: skip
    series_path = write_series(paths.summary.with_name(f"{args.name}-series.json"), samples)
    print(f"\n## {title}\n\n{tables.tables(rows)}\n")
    for path in (*paths, series_path):
        print(f"wrote {path}")
    bad = rows[0]["failed"] or rows[0]["differed"] or rows[0]["pull_failures"]
    not_flat = [f"{r['metric']}:{r['process']}" for r in rows[1:] if r["flat"] != "yes"]
    if not_flat:
        print(f"not flat: {', '.join(not_flat)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
