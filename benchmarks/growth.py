"""Cost as the work grows: pull time, KV bytes and TTFT overhead against prompt length, and the
engines' peak memory against concurrency.

    python -m benchmarks.growth [--full] [--out-dir DIR]

Three vLLMs of the tiny model at ``--max-model-len`` 16 384 (``--full``: 32 768): a plain one
(127.0.0.1) and our pair, prefill on 127.0.0.2 and decode on 127.0.0.3 (``MooncakeConnector``,
TCP, P2P handshake), behind our proxy. The prefill keeps vLLM's CPU default
``--max-num-batched-tokens`` (2 048): longer prompts take several steps on both sides alike.

1. **Length sweep**, one request at a time (streamed, 8 output tokens, greedy, fresh random
   prompts: no prefix-cache hit): for each length from 256 tokens to the model length, the
   client's TTFT through the pair and straight to the plain vLLM (interleaved, same prompts
   to each), and from the decode's own counters the KV bytes and the pull's time
   (``mooncake_vllm:pull_duration_seconds``). A least-squares line of pull time over bytes gives
   the fixed cost and the rate; each length's residual shows where the line stops fitting.
2. **Concurrency sweep**: prompts of 4 096 tokens at concurrency 1, 2, 4, 8 (``--full``: and 16),
   4 × c requests per level, while every process of each engine (API server, engine core,
   worker) is sampled every 0.2 s: the peak of the summed RSS per level and engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import psutil

from benchmarks import common
from harness import servers
from harness.pd import ServerSpec, kv_args, mooncake_json, sse_events, start_many
from harness.tiny_model import build_tiny_model
from harness.xpyd import start_pair_proxy

OUTPUT_TOKENS = 8
CONCURRENCY_PROMPT_TOKENS = 4096


def lengths(max_model_len: int) -> list[int]:
    """256, 512, ... up to the longest prompt that leaves room for the answer."""
    out, n = [], 256
    while n + OUTPUT_TOKENS <= max_model_len:
        out.append(n)
        n *= 2
    last = max_model_len - OUTPUT_TOKENS - 1
    if out[-1] < last:
        out.append(last)
    return out


def make_prompts(length: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 2000) for _ in range(length)] for _ in range(n)]


async def ttft(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    t0 = time.monotonic()
    first = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for event in sse_events(resp):
            if first is None and event.get("choices"):
                first = time.monotonic() - t0
    assert first is not None, "no token"
    return first


def pull_counters(decode: servers.VllmServer) -> dict[str, float]:
    m = decode.metrics(
        ["mooncake_vllm:pull_duration_seconds_sum", "mooncake_vllm:pull_duration_seconds_count",
         "mooncake_vllm:bytes_total", "mooncake_vllm:pull_failures_total"]
    )  # fmt: skip
    return {
        "pull_s": m.get("mooncake_vllm:pull_duration_seconds_sum", 0.0),
        "pulls": m.get("mooncake_vllm:pull_duration_seconds_count", 0.0),
        "bytes": m.get("mooncake_vllm:bytes_total", 0.0),
        "failures": m.get("mooncake_vllm:pull_failures_total", 0.0),
    }


def tree_rss_bytes(pid: int) -> int:
    """RSS of a process and all its descendants (vLLM's API server, engine core, worker)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


class RssSampler:
    """Peak summed RSS of each named process tree while running (a thread, every 0.2 s)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.peak = pids, dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], tree_rss_bytes(pid))
            self._stop.wait(0.2)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x``: (a, b, r²)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, 1 - ss_res / ss_tot if ss_tot else 1.0


async def length_sweep(model, plain, decode, proxy_url, sweep_lengths, per_length):
    samples, rows = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        # One short request each first: vLLM's first request pays for lazy setup.
        for url in (plain.url, proxy_url):
            await ttft(session, url, model, make_prompts(64, 1, seed=1)[0])
        for length in sweep_lengths:
            prompts = make_prompts(length, per_length, seed=length)
            pd_s, plain_s, pulls_s, kv_bytes = [], [], [], []
            for i, prompt in enumerate(prompts):
                before = pull_counters(decode)
                pd_s.append(await ttft(session, proxy_url, model, prompt))
                await asyncio.sleep(0.5)  # the step's counters reach /metrics
                after = pull_counters(decode)
                assert after["failures"] == before["failures"], "a pull failed"
                assert after["pulls"] - before["pulls"] == 1, (before, after)
                pulls_s.append(after["pull_s"] - before["pull_s"])
                kv_bytes.append(after["bytes"] - before["bytes"])
                # Another prompt of the same length for plain: a fresh one, no cache hit either.
                other = make_prompts(length, 1, seed=length * 1000 + i)[0]
                plain_s.append(await ttft(session, plain.url, model, other))
                samples.append(
                    {"length": length, "ttft_pd_s": pd_s[-1], "ttft_plain_s": plain_s[-1],
                     "pull_s": pulls_s[-1], "kv_bytes": kv_bytes[-1]}
                )  # fmt: skip
            row = {
                "tokens": length,
                "kv_MiB": round(statistics.median(kv_bytes) / 2**20, 2),
                "pull_ms_p50": round(statistics.median(pulls_s) * 1000, 1),
                "GB/s": round(statistics.median(kv_bytes) / statistics.median(pulls_s) / 1e9, 3),
                "ttft_plain_ms_p50": round(statistics.median(plain_s) * 1000, 1),
                "ttft_pd_ms_p50": round(statistics.median(pd_s) * 1000, 1),
                "overhead_ms_p50": round(
                    (statistics.median(pd_s) - statistics.median(plain_s)) * 1000, 1
                ),
            }
            rows.append(row)
            print(row, flush=True)
    return samples, rows


async def concurrency_sweep(model, proxy_url, pids, levels):
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        for c in levels:
            prompts = make_prompts(CONCURRENCY_PROMPT_TOKENS, 4 * c, seed=7000 + c)
            sem = asyncio.Semaphore(c)

            async def one(p, sem=sem):
                async with sem:
                    return await ttft(session, proxy_url, model, p)

            idle = {name: tree_rss_bytes(pid) for name, pid in pids.items()}
            with RssSampler(pids) as sampler:
                t0 = time.monotonic()
                firsts = await asyncio.gather(*(one(p) for p in prompts))
                took_s = time.monotonic() - t0
            row = {"concurrency": c, "requests": len(prompts), "wall_s": round(took_s, 1),
                   "ttft_ms_p50": round(statistics.median(firsts) * 1000, 1)}  # fmt: skip
            for name in pids:
                row[f"{name}_idle_MiB"] = round(idle[name] / 2**20)
                row[f"{name}_peak_MiB"] = round(sampler.peak[name] / 2**20)
            rows.append(row)
            print(row, flush=True)
    return rows


def plot(path: Path, length_rows, conc_rows, fit) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4))
    tokens = [r["tokens"] for r in length_rows]
    ax1.plot(tokens, [r["pull_ms_p50"] for r in length_rows], "o-", label="pull (decode)")
    ax1.plot(tokens, [r["overhead_ms_p50"] for r in length_rows], "s-",
             label="TTFT over plain")  # fmt: skip
    a, b, _ = fit
    ax1.plot(tokens, [(a + b * r["kv_MiB"] * 2**20) * 1000 for r in length_rows], "k:",
             label="line fit of pull on bytes")  # fmt: skip
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("symlog", linthresh=10)  # the TTFT difference can come out below zero
    ax1.axhline(0, color="grey", linewidth=0.5)
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("ms (p50)")
    ax1.legend(fontsize=8)
    ax2.plot(tokens, [r["ttft_plain_ms_p50"] for r in length_rows], "o-", label="plain")
    ax2.plot(tokens, [r["ttft_pd_ms_p50"] for r in length_rows], "s-", label="pair")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("TTFT ms (p50)")
    ax2.legend(fontsize=8)
    cs = [r["concurrency"] for r in conc_rows]
    for name in ("prefill", "decode"):
        ax3.plot(cs, [r[f"{name}_peak_MiB"] for r in conc_rows], "o-", label=f"{name} peak")
    ax3.set_xscale("log", base=2)
    ax3.set_xlabel(f"concurrency ({CONCURRENCY_PROMPT_TOKENS}-token prompts)")
    ax3.set_ylabel("RSS MiB (API server + engine core + worker)")
    ax3.legend(fontsize=8)
    common.save_figure(fig, path, "Cost as prompts and concurrency grow (tiny model, CPU)")


def main(argv: list[str] | None = None) -> int:
    parser = common.base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    max_model_len = 32_768 if args.full else 16_384
    per_length = 5 if args.full else 2
    levels = [1, 2, 4, 8, 16] if args.full else [1, 2, 4, 8]
    sweep_lengths = lengths(max_model_len)
    model = str(build_tiny_model())
    with tempfile.TemporaryDirectory(prefix="growth-") as tmp:
        cfg = mooncake_json(Path(tmp) / "mooncake.json")
        env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
        specs = [
            ServerSpec("growth-plain", "127.0.0.1", max_model_len=max_model_len),
            ServerSpec("growth-prefill", "127.0.0.2", kv_args("kv_producer"), env,
                       max_model_len=max_model_len),
            ServerSpec("growth-decode", "127.0.0.3", kv_args("kv_consumer"), env,
                       max_model_len=max_model_len),
        ]  # fmt: skip
        plain, prefill, decode = start_many(model, specs)
        proxy = None
        try:
            proxy = start_pair_proxy(prefill.url, decode.url)
            samples, length_rows = asyncio.run(
                length_sweep(model, plain, decode, proxy.url, sweep_lengths, per_length)
            )
            pids = {"prefill": prefill.process.proc.pid, "decode": decode.process.proc.pid}
            conc_rows = asyncio.run(concurrency_sweep(model, proxy.url, pids, levels))
        finally:
            for srv in (proxy, decode, prefill, plain):
                if srv is not None:
                    srv.stop()
    xs = [s["kv_bytes"] for s in samples]
    ys = [s["pull_s"] for s in samples]
    fit = fit_line(xs, ys)
    a, b, r2 = fit
    for row in length_rows:
        predicted_ms = (a + b * row["kv_MiB"] * 2**20) * 1000
        row["pull_vs_line"] = round(row["pull_ms_p50"] / predicted_ms, 2)
    notes = [
        f"pull time ≈ {a * 1000:.2f} ms + bytes ÷ {1 / b / 1e9:.3f} GB/s (least squares over "
        f"{len(xs)} pulls, r² {r2:.3f}); pull_vs_line: each length's p50 over that line",
        "TTFT overhead = p50 through the pair − p50 straight to plain vLLM (fresh prompts each)",
        f"concurrency rows: {CONCURRENCY_PROMPT_TOKENS}-token prompts, 4 × c requests per level; "
        "RSS summed over each engine's API server, engine core and worker, sampled every 0.2 s",
    ]
    settings = {"max_model_len": max_model_len, "per_length": per_length, "levels": levels,
                "output_tokens": OUTPUT_TOKENS, "lengths": sweep_lengths}  # fmt: skip
    paths = common.write_result(
        args.out_dir, "growth", settings=settings, samples=samples,
        rows=[*length_rows, *conc_rows], notes=notes,
        plot=lambda p: plot(p, length_rows, conc_rows, fit),
    )  # fmt: skip
    common.report("growth: prompt length", length_rows, [])
    common.report("growth: concurrency", conc_rows, [paths.summary, paths.plot])
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
