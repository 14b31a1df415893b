"""Prefix-aware routing against round robin: prefill prefix-cache hits and TTFT on multi-turn chats.

    python -m benchmarks.prefix_routing [--full] [--out-dir artifacts/bench]

Two prefills and one decode of the tiny model (real vLLMs with our connector, each on its own
127.0.0.x), and two proxies in front of the same three engines: ``--policy prefix`` and
``--policy round_robin``. The workload is multi-turn chats: each chat starts with one of a few
shared system prompts (token ids), and every turn resends the whole history plus a new user
message, as chat clients do. ``--concurrency`` clients each play chats turn by turn, streamed.

The policies run one after the other, alternating over ``--rounds``, each phase with system
prompts and chats of its own (no phase can hit what another one cached). Per phase: the prefills'
prefix-cache hit rate from vLLM's own counters (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``, in tokens, summed over both prefills), the requests each
prefill computed (``vllm:request_success_total``), and the TTFT each client saw.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from benchmarks import common
from harness import servers
from harness.pd import ServerSpec, kv_args, sse_events, start_many
from harness.tiny_model import build_tiny_model

POLICIES = ["round_robin", "prefix"]
PREFILL_HOSTS = ["127.0.0.41", "127.0.0.42"]
DECODE_HOST = "127.0.0.43"
TE_PORT = 13503  # the transfer engines' port on each host
MAX_MODEL_LEN = 2048
OUTPUT_TOKENS = 8
VOCAB = 2000  # token ids drawn below the tiny model's vocabulary (2048)


def make_chats(seed: int, systems: int, chats: int, turns: int, system_tokens: int,
               turn_tokens: int) -> list[list[list[int]]]:  # fmt: skip
    """``chats`` chats, each a list of ``turns`` prompts (token ids) growing turn by turn."""
    rng = random.Random(seed)
    system_prompts = [
        [rng.randrange(3, VOCAB) for _ in range(system_tokens)] for _ in range(systems)
    ]
    out = []
    for c in range(chats):
        history = list(system_prompts[c % systems])
        prompts = []
        for _ in range(turns):
            history += [rng.randrange(3, VOCAB) for _ in range(turn_tokens)]  # the user's turn
            prompts.append(list(history))
            # The assistant's answer joins the history (its ids as the client would resend them).
            history += [rng.randrange(3, VOCAB) for _ in range(OUTPUT_TOKENS)]
        out.append(prompts)
    rng.shuffle(out)
    return out


async def one_turn(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    first = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for event in sse_events(resp):
            if first is None and any(c.get("text") for c in event.get("choices", [])):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: no tokens streamed")
    return {"ttft_ms": (first - t0) * 1000, "prompt_tokens": len(prompt)}


async def run_phase(url: str, model: str, chats: list[list[list[int]]], concurrency: int):
    """Each client takes the next chat and plays its turns in order; returns per-turn results."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, chat in enumerate(chats):
        queue.put_nowait((i, chat))
    results: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            while not queue.empty():
                i, chat = queue.get_nowait()
                for turn, prompt in enumerate(chat):
                    try:
                        r = await one_turn(session, url, model, prompt)
                    except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                        r = {"error": str(e)[:300]}
                    results.append({"chat": i, "turn": turn, **r})

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


def prefill_counters(prefills: list[servers.VllmServer]) -> list[dict[str, float]]:
    out = []
    for p in prefills:
        m = p.metrics()
        out.append({
            "hits": m.get("vllm:prefix_cache_hits_total", 0.0),
            "queries": m.get("vllm:prefix_cache_queries_total", 0.0),
            "requests": m.get("vllm:request_success_total", 0.0),
        })  # fmt: skip
    return out


def summarize(samples: list[dict]) -> list[dict]:
    rows = []
    for policy in POLICIES:
        phases = [s for s in samples if s["policy"] == policy]
        turns = [t for s in phases for t in s["turns"]]
        ttft = [t["ttft_ms"] for t in turns if "ttft_ms" in t]
        hits = sum(s["hits"] for s in phases)
        queries = sum(s["queries"] for s in phases)
        per_prefill = [sum(s["requests_per_prefill"][i] for s in phases) for i in range(2)]
        later = [t["ttft_ms"] for t in turns if "ttft_ms" in t and t["turn"] > 0]
        rows.append({
            "policy": policy,
            "requests": len(turns),
            "errors": sum(1 for t in turns if "error" in t),
            "hit_rate_%": 100 * hits / queries if queries else float("nan"),
            "hit_tokens": hits,
            "query_tokens": queries,
            "per_prefill": "/".join(str(int(n)) for n in per_prefill),
            "ttft_p50_ms": common.percentile(ttft, 50),
            "ttft_p90_ms": common.percentile(ttft, 90),
            "ttft_p99_ms": common.percentile(ttft, 99),
            "later_turns_ttft_p50_ms": common.percentile(later, 50),
        })  # fmt: skip
    return rows


def plot(rows: list[dict], samples: list[dict]):
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        colors = ["#ff7f0e", "#1f77b4"]
        ax1.bar(POLICIES, [r["hit_rate_%"] for r in rows], color=colors)
        ax1.set_ylabel("prefill prefix-cache hit rate (% of prompt tokens)")
        ax1.set_ylim(0, 100)
        ax1.set_title("both prefills, vLLM's own counters")
        data = [
            [
                t["ttft_ms"]
                for s in samples
                if s["policy"] == p
                for t in s["turns"]
                if "ttft_ms" in t
            ]
            for p in POLICIES
        ]
        ax2.boxplot(data, showfliers=False)
        ax2.set_xticks(range(1, len(POLICIES) + 1), POLICIES)
        ax2.set_ylabel("TTFT through the proxy (ms)")
        ax2.set_title("every turn (whiskers: 1.5 IQR)")
        common.save_figure(fig, path, "prefix-aware routing vs round robin, 2 prefills + 1 decode")

    return draw


def start_stack(workdir: Path, log_dir: Path):
    """Two prefills, one decode, one proxy per policy; returns (model, prefills, urls, started)."""
    model = str(build_tiny_model())
    config = workdir / "mooncake.json"
    config.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                                  "device_name": ""}))  # fmt: skip
    env = {"MOONCAKE_CONFIG_PATH": str(config)}
    common_args = ["--max-model-len", str(MAX_MODEL_LEN), "--distributed-executor-backend", "uni"]
    specs = [
        ServerSpec(f"prefix-p{i}", host, [*common_args, *kv_args(
            "kv_producer", {"prefill_url": f"{host}:{TE_PORT}"}, engine_id=f"prefix-p{i}")], env)
        for i, host in enumerate(PREFILL_HOSTS)
    ] + [
        ServerSpec("prefix-d", DECODE_HOST, [*common_args, *kv_args(
            "kv_consumer", {"decode_url": f"{DECODE_HOST}:{TE_PORT}"}, engine_id="prefix-d",
            kv_load_failure_policy="recompute")], env),
    ]  # fmt: skip
    started: list = start_many(model, specs, timeout_s=1200, log_dir=log_dir)
    prefills, decode = started[:2], started[2]
    urls = {}
    for policy in POLICIES:
        port = servers.free_port()
        urls[policy] = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "mooncake_vllm.proxy.server", "--policy", policy,
                "--decode", decode.url, "--port", str(port), "--log-level", "warning"]  # fmt: skip
        for p in prefills:
            argv += ["--prefill", p.url]
        proc = servers.ManagedProcess(f"proxy-{policy}", argv, log_dir / f"proxy-{policy}.log")
        started.append(proc.start())
        proc.wait_until(lambda u=urls[policy]: servers.http_text(f"{u}/health") is not None, 60,
                        "healthy")  # fmt: skip
    return model, prefills, urls, started


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=None, help="phases per policy (quick 1, full 2)")
    ap.add_argument("--systems", type=int, default=None, help="shared system prompts per phase")
    ap.add_argument("--chats", type=int, default=None, help="chats per phase")
    ap.add_argument("--turns", type=int, default=None, help="turns per chat")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--turn-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.full else 1)
    systems = args.systems or (6 if args.full else 4)
    chats = args.chats or (24 if args.full else 12)
    turns = args.turns or (6 if args.full else 4)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-prefix-"))
    log_dir = workdir / "logs"
    log_dir.mkdir()
    samples: list[dict] = []
    started: list = []
    try:
        t0 = time.monotonic()
        model, prefills, urls, started = start_stack(workdir, log_dir)
        print(f"3 engines and 2 proxies up in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        # Warm-up (compiles, first connections) on prompts of its own.
        warm = make_chats(10_000, 1, 2, 1, 64, 8)
        for policy in POLICIES:
            asyncio.run(run_phase(urls[policy], model, warm, 2))
        phases = [
            (r, p) for r in range(rounds) for p in (POLICIES if r % 2 == 0 else POLICIES[::-1])
        ]
        for n, (r, policy) in enumerate(tqdm(phases, desc="phases", file=sys.stderr)):
            chat_set = make_chats(1000 * n + 1, systems, chats, turns, args.system_tokens,
                                  args.turn_tokens)  # fmt: skip
            before = prefill_counters(prefills)
            t_phase = time.perf_counter()
            results = asyncio.run(run_phase(urls[policy], model, chat_set, args.concurrency))
            seconds = time.perf_counter() - t_phase
            time.sleep(1.5)  # vLLM publishes its counters about once a second
            after = prefill_counters(prefills)
            samples.append({
                "policy": policy, "round": r, "seconds": seconds, "turns": results,
                "hits": sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True)),
                "queries": sum(a["queries"] - b["queries"]
                               for a, b in zip(after, before, strict=True)),
                "requests_per_prefill": [a["requests"] - b["requests"]
                                         for a, b in zip(after, before, strict=True)],
            })  # fmt: skip
    finally:
        for s in reversed(started):
            s.stop()
        servers.stop_all()
    rows = summarize(samples)
    settings = {
        "mode": "full" if args.full else "quick",
        "rounds": rounds, "systems": systems, "chats": chats, "turns": turns,
        "system_tokens": args.system_tokens, "turn_tokens": args.turn_tokens,
        "output_tokens": OUTPUT_TOKENS, "concurrency": args.concurrency,
        "engines": "2 prefills + 1 decode, tiny model, --distributed-executor-backend uni",
        "log_dir": str(log_dir),
    }  # fmt: skip
    paths = common.write_result(
        args.out_dir, "prefix_routing", settings=settings, samples=samples, rows=rows,
        notes=["hit rate: prefills' vllm:prefix_cache_hits_total / queries_total deltas",
               "per_prefill: requests each prefill completed (vllm:request_success_total)"],
        plot=plot(rows, samples),
    )  # fmt: skip
    common.report("prefix routing vs round robin", rows, paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
