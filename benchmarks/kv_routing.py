"""Routing by the engines' KV events (``--policy kv``) against ``prefix`` and round robin, 2P2D.

    python -m benchmarks.kv_routing [--full] [--out-dir artifacts/bench]

Two prefills and two decodes of the tiny model (real vLLMs with our connector, each on its own
127.0.0.x, each publishing its KV events), and three proxies in front of the same four engines:
``--policy round_robin``, ``prefix`` and ``kv``. The workload is multi-turn conversations
(``prefix_routing.make_chats``: a few shared system prompts, every turn resends the whole
history plus a new user message), ``--concurrency`` conversations at a time, as in issue 39's
conversation-trace slice (24 conversations, two at a time, ~100 requests).

The policies run one after the other on the same engines, each with conversations of its own
(no phase can hit what another cached). Per phase, from vLLM's own counters
(``vllm:prompt_tokens_by_source_total``):

- computed: prompt tokens the prefills computed (``local_compute``), against the bound: the
  tokens no system can avoid computing, i.e. per request, in the order sent, its tokens past the
  leading full blocks some earlier request already had (vLLM computes at least a prompt's last
  token, so at most ``(len - 1) // block`` blocks are reusable); ``computed_x`` = computed / bound;
- pulled: prompt tokens the decodes loaded by transfer (``external_kv_transfer``), against the
  least any routing needs (the same count: a decode that held every earlier block would pull
  only the rest); ``pulled_x`` = pulled / least;
- the share of the phase's requests each engine served (``vllm:request_success_total``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from benchmarks import common
from benchmarks.prefix_routing import OUTPUT_TOKENS, make_chats, one_turn
from harness import servers
from harness.pd import ServerSpec, kv_args, start_many
from harness.tiny_model import build_tiny_model
from mooncake_vllm.proxy.kv_index import block_keys

POLICIES = ["round_robin", "prefix", "kv"]
HOSTS = {"p0": "127.0.0.51", "p1": "127.0.0.52", "d0": "127.0.0.53", "d1": "127.0.0.54"}
TE_PORT = 13507
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 128  # vLLM's default on CPU


def reuse_bound(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Prompt tokens that must be computed (or pulled) whatever the routing: per prompt, in
    order, those past its leading full blocks seen in an earlier prompt (at most
    ``(len - 1) // block_size`` of them: the last token is always computed)."""
    seen: set[int] = set()
    total = 0
    for prompt in prompts:
        keys = block_keys(prompt, block_size)
        reusable = 0
        for key in keys[: (len(prompt) - 1) // block_size]:
            if key not in seen:
                break
            reusable += 1
        total += len(prompt) - reusable * block_size
        seen.update(keys)
    return total


async def run_phase(url: str, model: str, chats, concurrency: int):
    """Each client takes the next chat and plays its turns in order; returns the per-turn
    results and the prompts in the order they were sent."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, chat in enumerate(chats):
        queue.put_nowait((i, chat))
    results: list[dict] = []
    sent: list[list[int]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def client() -> None:
            while not queue.empty():
                i, chat = queue.get_nowait()
                for turn, prompt in enumerate(chat):
                    sent.append(prompt)
                    try:
                        r = await one_turn(session, url, model, prompt)
                    except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                        r = {"error": str(e)[:300]}
                    results.append({"chat": i, "turn": turn, **r})

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, sent


def counters(engines: dict[str, servers.VllmServer]) -> dict[str, dict[str, float]]:
    out = {}
    for name, srv in engines.items():
        m = {
            source: srv.metric("vllm:prompt_tokens_by_source_total", source=source)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }
        m["requests"] = srv.metric("vllm:request_success_total")
        m["pull_failures"] = srv.metric("mooncake_vllm:pull_failures_total")
        out[name] = m
    return out


def phase_row(policy: str, before, after, results, sent) -> dict:
    def delta(name: str, key: str) -> float:
        return after[name][key] - before[name][key]

    bound = reuse_bound(sent, BLOCK_SIZE)
    computed = sum(delta(n, "local_compute") for n in ("p0", "p1"))
    pulled = sum(delta(n, "external_kv_transfer") for n in ("d0", "d1"))
    requests = {n: delta(n, "requests") for n in HOSTS}
    served = sum(requests[n] for n in ("p0", "p1")) or 1
    decoded = sum(requests[n] for n in ("d0", "d1")) or 1
    share = {n: requests[n] / (served if n.startswith("p") else decoded) for n in HOSTS}
    return {
        "policy": policy,
        "requests": len(results),
        "errors": sum(1 for r in results if "error" in r),
        "bound_tokens": bound,
        "computed_tokens": computed,
        "computed_x": computed / bound,
        "pulled_tokens": pulled,
        "pulled_x": pulled / bound,
        "pull_failures": sum(delta(n, "pull_failures") for n in ("d0", "d1")),
        "max_share_%": 100 * max(share.values()),
        "share_p0/p1/d0/d1_%": "/".join(f"{100 * share[n]:.0f}" for n in HOSTS),
        "ttft_p50_ms": common.percentile([r["ttft_ms"] for r in results if "ttft_ms" in r], 50),
    }


def plot(rows: list[dict]):
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        x = range(len(rows))
        ax1.bar([i - 0.2 for i in x], [r["computed_x"] for r in rows], 0.4, label="computed")
        ax1.bar([i + 0.2 for i in x], [r["pulled_x"] for r in rows], 0.4, label="pulled")
        ax1.axhline(1.05, color="grey", linestyle="--", linewidth=1, label="goal 1.05x")
        ax1.set_xticks(list(x), [r["policy"] for r in rows])
        ax1.set_ylabel("prompt tokens / the workload's reuse bound")
        ax1.legend()
        shares = [[float(s) for s in r["share_p0/p1/d0/d1_%"].split("/")] for r in rows]
        for j, name in enumerate(HOSTS):
            ax2.bar([i + (j - 1.5) * 0.2 for i in x], [s[j] for s in shares], 0.2, label=name)
        ax2.axhline(60, color="grey", linestyle="--", linewidth=1)
        ax2.set_xticks(list(x), [r["policy"] for r in rows])
        ax2.set_ylabel("share of the role's requests (%)")
        ax2.legend()
        common.save_figure(fig, path, "routing on KV events vs prefix vs round robin, 2P2D")

    return draw


def start_stack(log_dir: Path, workdir: Path):
    model = str(build_tiny_model())
    config = workdir / "mooncake.json"
    config.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                                  "device_name": ""}))  # fmt: skip
    env = {"MOONCAKE_CONFIG_PATH": str(config)}
    events_port = {n: servers.free_port("0.0.0.0") for n in HOSTS}
    specs = []
    for name, host in HOSTS.items():
        producer = name.startswith("p")
        extra = {("prefill_url" if producer else "decode_url"): f"{host}:{TE_PORT}"}
        top = {"engine_id": f"kvroute-{name}"}
        if not producer:
            top["kv_load_failure_policy"] = "recompute"
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{events_port[name]}"}  # fmt: skip
        args = ["--max-model-len", str(MAX_MODEL_LEN), "--distributed-executor-backend", "uni",
                *kv_args("kv_producer" if producer else "kv_consumer", extra, **top),
                "--kv-events-config", json.dumps(events)]  # fmt: skip
        specs.append(ServerSpec(f"kvroute-{name}", host, args, env))
    started: list = start_many(model, specs, timeout_s=1200, log_dir=log_dir)
    engines = dict(zip(HOSTS, started, strict=True))
    urls = {}
    for policy in POLICIES:
        port = servers.free_port()
        urls[policy] = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "mooncake_vllm.proxy.server", "--policy", policy,
                "--port", str(port), "--log-level", "warning"]  # fmt: skip
        for name, srv in engines.items():
            argv += ["--prefill" if name.startswith("p") else "--decode", srv.url]
            if policy == "kv":
                argv += [f"--kv-events={srv.url}=tcp://{HOSTS[name]}:{events_port[name]}"]
        proc = servers.ManagedProcess(f"proxy-{policy}", argv, log_dir / f"proxy-{policy}.log")
        started.append(proc.start())
        proc.wait_until(lambda u=urls[policy]: servers.http_text(f"{u}/health") is not None, 60,
                        "healthy")  # fmt: skip
    return model, engines, urls, started


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--systems", type=int, default=4, help="shared system prompts per phase")
    ap.add_argument("--chats", type=int, default=None, help="conversations per phase (24)")
    ap.add_argument("--turns", type=int, default=None, help="turns per conversation (4)")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=2)
    args = ap.parse_args(argv)
    chats = args.chats or (24 if args.full else 12)
    turns = args.turns or (4 if args.full else 3)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-kvroute-"))
    log_dir = workdir / "logs"
    log_dir.mkdir()
    rows: list[dict] = []
    samples: list[dict] = []
    started: list = []
    try:
        t0 = time.monotonic()
        model, engines, urls, started = start_stack(log_dir, workdir)
        print(f"4 engines and 3 proxies up in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        warm = make_chats(10_000, 1, 2, 1, 64, 8)
        for policy in POLICIES:
            asyncio.run(run_phase(urls[policy], model, warm, 2))
        for n, policy in enumerate(POLICIES):
            chat_set = make_chats(7000 + n, args.systems, chats, turns, args.system_tokens,
                                  args.turn_tokens)  # fmt: skip
            time.sleep(1.5)  # vLLM publishes its counters about once a second
            before = counters(engines)
            results, sent = asyncio.run(run_phase(urls[policy], model, chat_set, args.concurrency))
            time.sleep(1.5)
            after = counters(engines)
            rows.append(phase_row(policy, before, after, results, sent))
            samples.append({"policy": policy, "turns": results, "before": before, "after": after})
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        for s in reversed(started):
            s.stop()
        servers.stop_all()
    settings = {
        "mode": "full" if args.full else "quick", "systems": args.systems, "chats": chats,
        "turns": turns, "system_tokens": args.system_tokens, "turn_tokens": args.turn_tokens,
        "output_tokens": OUTPUT_TOKENS, "concurrency": args.concurrency,
        "block_size": BLOCK_SIZE,
        "engines": "2 prefills + 2 decodes, tiny model, --distributed-executor-backend uni",
        "log_dir": str(log_dir),
    }  # fmt: skip
    paths = common.write_result(
        args.out_dir, "kv_routing", settings=settings, samples=samples, rows=rows,
        notes=["computed: prefills' prompt_tokens_by_source{local_compute}; pulled: decodes' "
               "{external_kv_transfer}; bound: reuse_bound over the prompts in the order sent",
               "share: each engine's vllm:request_success_total over its role's total"],
        plot=plot(rows),
    )  # fmt: skip
    common.report("routing on KV events vs prefix vs round robin (2P2D)", rows, paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
