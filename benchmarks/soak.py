"""Soak: many pulls through the proxy on the setup a new user tries first, counting every failure.

One host (prefill and decode both on 127.0.0.1), vLLM's default ``fail`` policy, requests of mixed
lengths (1-1500 tokens) streamed through ``proxy/proxy_server.py`` at a fixed concurrency, with idle
gaps between waves. Reported from the engines' own counters: pulls, failed pulls, entry retries and
stalls, the share of decode's prompt tokens that arrived by transfer, and the acquire and read
duration quantiles (bucket upper bounds); from the client: failed requests and TTFT.

    python -m benchmarks.soak --full --out-dir benchmarks/results   # 1000 requests (~10 min)

For an hour at steady load with every process's memory, fds, threads and sockets sampled, see
``benchmarks.soak_trace`` (``make soak``).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks import common
from harness import servers
from harness.pd import ServerSpec, client_session, kv_args, sse_events, start_many
from harness.tiny_model import build_tiny_model

HOST = "127.0.0.1"
MAX_TOKENS = 8
REPO = Path(__file__).resolve().parent.parent


def start(workdir: Path, log_dir: Path):
    cfg = workdir / "mooncake.json"
    cfg.write_text(
        json.dumps(
            {
                "prefill_url": f"{HOST}:15100",
                "decode_url": f"{HOST}:15200",
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "device_name": "",
            }
        )
    )
    env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
    model = str(build_tiny_model())
    specs = [
        ServerSpec("soak-prefill", HOST, kv_args("kv_producer"), env),
        ServerSpec("soak-decode", HOST, kv_args("kv_consumer"), env),
    ]
    prefill, decode = start_many(model, specs, log_dir=log_dir)
    port = servers.free_port()
    proxy = servers.ManagedProcess(
        "soak-proxy",
        [sys.executable, str(REPO / "proxy" / "proxy_server.py"),
         "--prefill", prefill.url, "--decode", decode.url, "--port", str(port)],
        log_dir / f"soak-proxy-{port}.log",
    ).start()  # fmt: skip
    url = f"http://{HOST}:{port}"
    proxy.wait_until(lambda: servers.http_text(f"{url}/health") != "", 60, "healthy")
    return model, prefill, decode, proxy, url


async def one(http, url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}  # fmt: skip
    t0 = time.monotonic()
    sample = {"prompt_tokens": len(prompt), "ok": False, "ttft_ms": None, "error": None}
    try:
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                sample["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return sample
            async for _event in sse_events(resp):
                if sample["ttft_ms"] is None:
                    sample["ttft_ms"] = 1000 * (time.monotonic() - t0)
        sample["ok"] = True
    except Exception as e:  # every failure is counted and kept with its message
        sample["error"] = f"{type(e).__name__}: {e}"
    return sample


async def soak(url: str, model: str, requests: int, concurrency: int, wave: int, gap_s: float,
               seed: int) -> list[dict]:  # fmt: skip
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    samples: list[dict] = []
    bar = tqdm(total=requests, desc="soak requests", file=sys.stderr)

    async def run(i: int, http) -> None:
        n = rng.randrange(1, 200) if i % 2 else rng.randrange(200, 1500)
        prompt = [rng.randrange(3, 2048) for _ in range(n)]
        async with gate:
            sample = await one(http, url, model, prompt)
        samples.append({"i": i, **sample})
        bar.update()

    async with client_session() as http:
        for start_i in range(0, requests, wave):
            if start_i:
                await asyncio.sleep(gap_s)  # idle gap: connections and engines go quiet
            await asyncio.gather(
                *(run(i, http) for i in range(start_i, min(requests, start_i + wave)))
            )
    bar.close()
    return sorted(samples, key=lambda s: s["i"])


def plot(samples: list[dict]):
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        ok = [s for s in samples if s["ttft_ms"] is not None]
        ax.scatter([s["i"] for s in ok], [s["ttft_ms"] for s in ok], s=6,
                   c=[s["prompt_tokens"] for s in ok], cmap="viridis")  # fmt: skip
        ax.set_xlabel("request (in send order; color: prompt tokens)")
        ax.set_ylabel("TTFT through the proxy (ms)")
        ax.set_yscale("log")
        common.save_figure(fig, path, "soak: one host, default fail policy, streamed via proxy")

    return draw


def main(argv: list[str] | None = None, attach: tuple | None = None) -> int:
    """``attach=(model, prefill, decode, proxy_url)``: soak servers someone else started (the
    test suite's shared pair) instead of starting a one-host pair."""
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--wave", type=int, default=100, help="requests between idle gaps")
    ap.add_argument("--gap-s", type=float, default=6.0, help="idle gap between waves")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    requests = args.requests or (1000 if args.full else 60)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-soak-"))
    log_dir = workdir / "logs"
    print(f"starting servers (logs in {log_dir})", flush=True)
    if attach is None:
        model, prefill, decode, proxy, url = start(workdir, log_dir)
    else:
        (model, prefill, decode, url), proxy = attach, None
    try:
        ext_name = "vllm:prompt_tokens_by_source_total"
        ext0 = decode.metric(ext_name, source="external_kv_transfer")
        counters = ("pulls_total", "pull_failures_total", "retries_total", "stalls_total")
        c0 = {c: decode.metric(f"mooncake_vllm:{c}") for c in counters}
        h_names = ("acquire_duration_seconds", "read_duration_seconds")
        h0 = {h: decode.histogram(f"mooncake_vllm:{h}") for h in h_names}
        t0 = time.monotonic()
        samples = asyncio.run(
            soak(url, model, requests, args.concurrency, args.wave, args.gap_s, args.seed)
        )
        wall_s = time.monotonic() - t0
        time.sleep(2)  # the last step's stats reach /metrics
        ext = decode.metric(ext_name, source="external_kv_transfer") - ext0
        c = {k: decode.metric(f"mooncake_vllm:{k}") - c0[k] for k in counters}
        h1 = {h: decode.histogram(f"mooncake_vllm:{h}") for h in h_names}
    finally:
        if attach is None:
            proxy.stop()
            decode.stop()
            prefill.stop()
    ok = [s for s in samples if s["ok"]]
    ttft = [s["ttft_ms"] for s in ok if s["ttft_ms"] is not None]

    def q_ms(h: str, q: float) -> float:
        return 1000 * servers.histogram_quantile(h0[h], h1[h], q)

    row = {
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "pulls": int(c["pulls_total"]),
        "pull_failures": int(c["pull_failures_total"]),
        "retries": int(c["retries_total"]),
        "stalls": int(c["stalls_total"]),
        "ext_share": round(ext / sum(s["prompt_tokens"] for s in samples), 4),
        "acq_p50_ms<=": q_ms("acquire_duration_seconds", 0.5),
        "acq_p99_ms<=": q_ms("acquire_duration_seconds", 0.99),
        "read_p50_ms<=": q_ms("read_duration_seconds", 0.5),
        "read_p99_ms<=": q_ms("read_duration_seconds", 0.99),
        "ttft_p50_ms": round(common.percentile(ttft, 50), 1),
        "ttft_p99_ms": round(common.percentile(ttft, 99), 1),
        "wall_s": round(wall_s, 1),
    }
    settings = {
        "mode": "full" if args.full else "quick",
        "requests": requests,
        "concurrency": args.concurrency,
        "wave": args.wave,
        "gap_s": args.gap_s,
        "seed": args.seed,
        "max_tokens": MAX_TOKENS,
        "log_dir": str(log_dir),
        "errors": sorted({s["error"] for s in samples if s["error"]})[:20],
    }
    where = "one host (127.0.0.1)" if attach is None else f"{prefill.url} -> {decode.url}"
    notes = [
        f"{where}, vLLM's default kv_load_failure_policy (fail), TCP, P2P handshake",
        "quantiles of our histograms are bucket upper bounds",
    ]
    paths = common.write_result(
        args.out_dir, "soak", settings=settings, samples=samples, rows=[row], notes=notes,
        plot=plot(samples),
    )  # fmt: skip
    common.report("soak: pulls through the proxy on one host", [row], paths)
    return 0 if row["failed"] == 0 and row["pull_failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
