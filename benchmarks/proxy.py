"""What the proxy costs: added latency and maximum requests/s, against direct calls and a toy proxy.

    python -m benchmarks.proxy [--full] [--out-dir artifacts/bench]

Backends are two instant OpenAI-shaped servers (``benchmarks.fake_backend``: a prefill and a
decode), so every millisecond measured is the proxy's own. Targets, each in front of them:

- ``direct``: the client calls decode itself (one request, no proxy) — the issue's reference;
- ``direct_2leg``: the client does both legs itself (prefill, then decode) — what a proxy must do
  at least, so ``proxy - direct_2leg`` is the proxy's own overhead;
- ``ours_granian``, ``ours_uvicorn``, ``ours_hypercorn``: ``mooncake_vllm.proxy.server`` (the same
  Quart app) served by each ASGI server it supports (``--server``; uvicorn with httptools, all on
  uvloop), so the default can be the fastest of one run;
- ``ours_traced``: ours on uvicorn (the default server) with ``--otlp-traces-endpoint`` (three
  spans a request, exported by OTLP/HTTP to a receiver in this process that only counts them):
  what tracing costs, against ``ours_uvicorn`` with it off;
- ``toy``: ``benchmarks.toy_proxy`` (FastAPI + httpx on uvicorn).

Latency: one request at a time, targets interleaved round by round (so drift hits all alike);
each proxy's CPU time (user + system, from /proc) over that phase, per request it served, is
``server_cpu_us_per_req`` (its own work, less sensitive to a busy box than its latency).
Throughput: a closed loop of ``--concurrency`` clients for a fixed time per target. All servers
log at warning level (request logging is a deployment choice, not the proxy's cost).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from benchmarks import common
from harness.otlp import Receiver
from harness.servers import ManagedProcess, free_port, http_text

SERVERS = ["granian", "uvicorn", "hypercorn"]
TARGETS = ["direct", "direct_2leg", *(f"ours_{s}" for s in SERVERS), "ours_traced", "toy"]
WARMUP = 50  # requests per target before the measured rounds
BODY = {"model": "bench", "prompt": "hello " * 32, "max_tokens": 4, "temperature": 0}


def _start(name: str, argv: list[str], url: str, log_dir: Path) -> ManagedProcess:
    proc = ManagedProcess(name, [sys.executable, "-m", *argv], log_dir / f"{name}.log").start()
    proc.wait_until(lambda: http_text(f"{url}/health", timeout_s=2) is not None, 60, "healthy")
    return proc


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with session.post(url + "/v1/completions", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}")


def _caller(target: str, urls: dict[str, str]):
    """One request to ``target`` as the client sees it."""
    if target == "direct_2leg":
        prefill_body = {
            **BODY,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "x"},
        }

        async def call(session):
            await _post(session, urls["prefill"], prefill_body)
            await _post(session, urls["decode"], BODY)

        return call
    url = urls["decode"] if target == "direct" else urls[target]
    return lambda session: _post(session, url, BODY)


async def measure_latency(urls, rounds: int, per_round: int, warmup: int) -> list[dict]:
    samples = []
    calls = {t: _caller(t, urls) for t in TARGETS}
    async with aiohttp.ClientSession() as session:
        for t in TARGETS:
            for _ in range(warmup):
                await calls[t](session)
        for r in tqdm(range(rounds), desc="latency rounds", file=sys.stderr):
            for t in TARGETS:
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    await calls[t](session)
                    ms = (time.perf_counter() - t0) * 1000
                    samples.append({"phase": "latency", "target": t, "round": r, "ms": ms})
    return samples


async def _closed_loop(session, call, concurrency: int, duration_s: float):
    """``concurrency`` clients each sending the next request when the last one is answered."""
    counts = {"done": 0, "errors": 0}
    stop_at = time.perf_counter() + duration_s

    async def client():
        while time.perf_counter() < stop_at:
            try:
                await call(session)
                counts["done"] += 1
            except (aiohttp.ClientError, RuntimeError):
                counts["errors"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return counts["done"], counts["errors"], time.perf_counter() - t0


async def measure_throughput(urls, duration_s: float, concurrency: int) -> list[dict]:
    samples = []
    for t in tqdm(TARGETS, desc="throughput", file=sys.stderr):
        call = _caller(t, urls)
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            await _closed_loop(session, call, concurrency, 0.5)  # warm-up
            done, errors, elapsed = await _closed_loop(session, call, concurrency, duration_s)
        samples.append(
            {
                "phase": "throughput",
                "target": t,
                "requests": done,
                "errors": errors,
                "seconds": elapsed,
                "concurrency": concurrency,
                "rps": done / elapsed,
            }
        )
    return samples


def summarize(samples: list[dict], cpu_us: dict[str, float] | None = None) -> list[dict]:
    lat = {
        t: [s["ms"] for s in samples if s["phase"] == "latency" and s["target"] == t]
        for t in TARGETS
    }
    rps = {s["target"]: s["rps"] for s in samples if s["phase"] == "throughput"}
    base = {q: common.percentile(lat["direct"], q) for q in (50, 99)}
    base2 = {q: common.percentile(lat["direct_2leg"], q) for q in (50, 99)}
    rows = []
    for t in TARGETS:
        p = {q: common.percentile(lat[t], q) for q in (50, 90, 99)}
        rows.append(
            {
                "target": t,
                "n": len(lat[t]),
                "p50_ms": p[50],
                "p90_ms": p[90],
                "p99_ms": p[99],
                "added_p50_ms_vs_direct": p[50] - base[50],
                "added_p99_ms_vs_direct": p[99] - base[99],
                "added_p50_ms_vs_2leg": p[50] - base2[50],
                "ratio_p50_vs_2leg": p[50] / base2[50],
                "server_cpu_us_per_req": (cpu_us or {}).get(t, float("nan")),
                "max_rps": rps.get(t, float("nan")),
                "rps_vs_toy": rps.get(t, float("nan")) / rps["toy"]
                if rps.get("toy")
                else float("nan"),
            }
        )
    return rows


def plot(rows: list[dict], samples: list[dict]):
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.5))
        data = [
            [s["ms"] for s in samples if s.get("target") == t and s["phase"] == "latency"]
            for t in TARGETS
        ]
        ax1.boxplot(data, showfliers=False)
        ax1.set_xticks(range(1, len(TARGETS) + 1), TARGETS, rotation=20)
        ax1.set_ylabel("latency per request (ms)")
        ax1.set_title("one request at a time (whiskers: 1.5 IQR)")
        colors = ["#999", "#bbb", "#1f77b4", "#4a9ad4", "#9cc7e8", "#2ca02c", "#ff7f0e"]
        ax2.bar(TARGETS, [r["max_rps"] for r in rows], color=colors)
        ax2.tick_params(axis="x", labelrotation=20)
        ax2.set_ylabel("requests/s")
        conc = next((s["concurrency"] for s in samples if s["phase"] == "throughput"), "?")
        ax2.set_title(f"closed loop, {conc} clients")
        common.save_figure(fig, path, "proxy cost in front of instant backends")

    return draw


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=None, help="latency rounds (quick 10, full 40)")
    ap.add_argument("--per-round", type=int, default=None, help="requests per target per round")
    ap.add_argument("--duration-s", type=float, default=None, help="throughput time per target")
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args(argv)
    rounds = args.rounds or (40 if args.full else 10)
    per_round = args.per_round or (25 if args.full else 10)
    duration_s = args.duration_s or (10.0 if args.full else 3.0)
    log_dir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-proxy-"))
    procs: list[ManagedProcess] = []
    receiver = Receiver(keep=False)  # ours_traced's spans, counted
    try:
        urls = {}
        for role in ("prefill", "decode"):
            port = free_port()
            urls[role] = f"http://127.0.0.1:{port}"
            procs.append(
                _start(role, ["benchmarks.fake_backend", "--port", str(port)], urls[role], log_dir)
            )
        for server in SERVERS:
            port, name = free_port(), f"ours_{server}"
            urls[name] = f"http://127.0.0.1:{port}"
            procs.append(_start(name, [
                "mooncake_vllm.proxy.server", "--prefill", urls["prefill"], "--decode",
                urls["decode"], "--port", str(port), "--log-level", "warning", "--server", server,
            ], urls[name], log_dir))  # fmt: skip
        port = free_port()
        urls["ours_traced"] = f"http://127.0.0.1:{port}"
        procs.append(_start("ours_traced", [
            "mooncake_vllm.proxy.server", "--prefill", urls["prefill"], "--decode",
            urls["decode"], "--port", str(port), "--log-level", "warning", "--server", "uvicorn",
            "--otlp-traces-endpoint", receiver.endpoint,
        ], urls["ours_traced"], log_dir))  # fmt: skip
        port = free_port()
        urls["toy"] = f"http://127.0.0.1:{port}"
        procs.append(_start("toy", [
            "benchmarks.toy_proxy", "--prefill", urls["prefill"], "--decode", urls["decode"],
            "--port", str(port),
        ], urls["toy"], log_dir))  # fmt: skip
        servers = [p for p in procs if p.name not in ("prefill", "decode")]
        cpu_before = {p.name: p.cpu_s() for p in servers}
        samples = asyncio.run(measure_latency(urls, rounds, per_round, warmup=WARMUP))
        served = WARMUP + rounds * per_round
        cpu_us = {p.name: (p.cpu_s() - cpu_before[p.name]) / served * 1e6 for p in servers}
        samples += asyncio.run(measure_throughput(urls, duration_s, args.concurrency))
    finally:
        for p in reversed(procs):
            p.stop(grace_s=5)
        receiver.stop()
    rows = summarize(samples, cpu_us)
    settings = {
        "mode": "full" if args.full else "quick",
        "rounds": rounds,
        "per_round": per_round,
        "duration_s": duration_s,
        "concurrency": args.concurrency,
        "body": BODY,
        "stream": False,
        "spans_received": receiver.count,
        "log_dir": str(log_dir),
    }
    paths = common.write_result(
        args.out_dir, "proxy", settings=settings, samples=samples, rows=rows,
        notes=["backends: benchmarks.fake_backend (instant answers)", "servers log at warning"],
        plot=plot(rows, samples),
    )  # fmt: skip
    common.report("proxy: latency and max requests/s", rows, paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
