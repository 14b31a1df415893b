"""The KV pool end to end: our MooncakeStoreConnector against vLLM's own, in one run.

    python -m benchmarks.pool [--full] [--out-dir artifacts/bench]

For each connector (``ours``: this package's ``MooncakeStoreConnector``; ``vllm``: vLLM 0.32's
store connector, selected as ``VllmMooncakeStoreConnector`` through our plugin) one stack of real
servers on this machine: a ``mooncake_master`` with its http metadata server, one prefill and two
decodes of the tiny model, all ``kv_both``, all reading the same ``MOONCAKE_CONFIG_PATH`` json.
The stacks run one after the other; a plain vLLM (prefix caching off: it computes every token)
runs throughout as the reference.

Requests go the way of the minimal proxy in Mooncake's vLLM guide, played by this client: the
request to prefill with ``max_tokens=1``, then the original request (streamed) to a decode,
nothing passed between them. Prompts are seeded random token ids of 200-1400 tokens.

- (a) decode1 behind the minimal proxy: its share of prompt tokens from the pool (vLLM's own
  ``vllm:prompt_tokens_by_source_total``: ``external_kv_transfer`` over all sources), failed
  requests, and the prefill leg's time against plain vLLM's for the same prompt with
  ``max_tokens=1`` (what saving into the pool costs prefill TTFT), measured alternately;
- (b) decode2, which never saw those prompts, asked for them afterwards: its share from the pool;
- (c) every answer's token ids against plain vLLM's (greedy, ``ignore_eos``);
- (d) prefix reuse: one shared system prompt (1100 tokens) prefilled once into the pool, then
  requests of it plus a different suffix (50-300 tokens) each, sent in turn to plain vLLM
  (computes everything), to decode2 (started with ``--no-enable-prefix-caching``, so every
  request must take the shared prefix from the pool, as a fresh instance or one whose cache
  evicted it) and to decode1 (its own prefix cache holds the prefix after the first request):
  TTFT p50/p99 of each. Each target gets suffixes of its own (the same lengths), so none finds
  another's suffix in the pool.

Every timed request (and each minimal-proxy pair) starts after a 1.2 s pause (``--quiet-s``): a
vLLM worker busy-waits for about a second after each step, which on 2 cores slows whatever runs
next. Within a pair the decode leg follows the prefill's answer at once, as in the guide.

vLLM's connector gets, beside the json, a ``lookup_rpc_port`` of its own per instance in
``kv_connector_extra_config`` (its scheduler asks the worker over an ipc socket named after that
port and the hostname: instances on one host would otherwise bind the same path;
``--no-lookup-ports`` leaves it out) and ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME`` (it advertises
the host's first address otherwise).
**Runtime workaround**: its servers get ``benchmarks/builtin_store_cpu_workaround`` on
``PYTHONPATH``, a sitecustomize that makes ``torch.cuda.Event`` an always-complete event on
CPU-only torch (its ``wait_for_save`` creates one for every save, which kills the worker there
otherwise). vLLM's files are not modified.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from benchmarks import common
from harness import servers
from harness.pd import ServerSpec, client_session, complete, sse_events, start_many
from harness.tiny_model import build_tiny_model

CONNECTORS = ["ours", "vllm"]
KV_CONNECTOR = {"ours": "MooncakeStoreConnector", "vllm": "VllmMooncakeStoreConnector"}
OUTPUT_TOKENS = 8
VOCAB_LOW, VOCAB_HIGH = 3, 2000  # the tiny model's vocabulary is 2048 ids
PROMPT_MIN, PROMPT_MAX = 200, 1400
SYSTEM_TOKENS = 1100
SUFFIX_MIN, SUFFIX_MAX = 50, 300
SEGMENT = "512MB"  # per instance: 1.5 GB of pool per stack, well above any run's prompts
SOURCES = ("external_kv_transfer", "local_cache_hit", "local_compute")
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
TARGETS = {"decode1": 0.95, "decode2": 0.90}  # issue 13's share targets
PREFIX_TARGETS = ["plain", "pool", "local_cache"]  # (d): plain, decode2, decode1
QUIET_S = 1.2
WORKAROUND_DIR = Path(__file__).parent / "builtin_store_cpu_workaround"
WORKAROUND_NOTE = (
    "vLLM's store connector servers ran with benchmarks/builtin_store_cpu_workaround on "
    "PYTHONPATH: a sitecustomize making torch.cuda.Event an always-complete event on CPU-only "
    "torch (vLLM 0.32's MooncakeStoreConnector creates one in wait_for_save for every save and "
    "its worker dies there otherwise); vLLM's files unmodified"
)


def token_prompts(rng: random.Random, n: int, low: int, high: int) -> list[list[int]]:
    return [
        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(low, high))]
        for _ in range(n)
    ]


def body(model: str, prompt: list[int], **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, **kw}  # fmt: skip


async def streamed(http: aiohttp.ClientSession, url: str, request: dict) -> dict:
    """One streamed completion: TTFT (first token ids), latency and the answer's token ids."""
    request = {**request, "stream": True, "return_token_ids": True}
    ids: list[int] = []
    t0 = time.perf_counter()
    first = None
    async with http.post(f"{url}/v1/completions", json=request) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for event in sse_events(resp):
            for choice in event.get("choices", []):
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    ids.extend(choice["token_ids"])
    if first is None:
        raise RuntimeError("no tokens streamed")
    end = time.perf_counter()
    return {"ttft_ms": (first - t0) * 1000, "latency_ms": (end - t0) * 1000, "token_ids": ids}


async def one_token_ms(http: aiohttp.ClientSession, url: str, request: dict) -> float:
    """The minimal proxy's prefill leg: ``max_tokens=1``, not streamed; its latency in ms."""
    t0 = time.perf_counter()
    await complete(http, url, {**request, "max_tokens": 1, "stream": False})
    return (time.perf_counter() - t0) * 1000


async def attempt(coro) -> tuple[object, str | None]:
    try:
        return await coro, None
    except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
        return None, f"{type(e).__name__}: {e}"[:300]


def by_source(srv: servers.VllmServer) -> dict[str, float]:
    return {s: srv.metric(BY_SOURCE, source=s) for s in SOURCES}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def settle() -> None:
    time.sleep(2.0)  # vLLM publishes its counters about once a second


class Run:
    """One connector's stack and the plain reference, with the phases (a), (b), (d)."""

    def __init__(self, connector, model, plain, prefill, decode1, decode2, refs, quiet_s):
        self.connector, self.model, self.quiet_s = connector, model, quiet_s
        self.plain, self.prefill, self.decode1, self.decode2 = plain, prefill, decode1, decode2
        self.refs = refs  # prompt (tuple) -> plain's token ids
        self.samples: list[dict] = []

    def sample(self, phase: str, prompt: list[int], **fields) -> dict:
        s = {"connector": self.connector, "phase": phase, "prompt_tokens": len(prompt), **fields}
        self.samples.append(s)
        return s

    async def quiet(self) -> None:
        """Let the server that answered last go idle before the next timed request: after a
        step, a vLLM worker busy-waits on its queue for about a second, which on 2 cores would
        slow whichever server is timed next (``--quiet-s``)."""
        await asyncio.sleep(self.quiet_s)

    def check(self, prompt: list[int], got: dict | None) -> bool | None:
        ref = self.refs.get(tuple(prompt))
        return None if got is None or ref is None else got["token_ids"] == ref

    async def handover(self, http, prompts: list[list[int]], bar) -> dict:
        """(a): plain's max_tokens=1 time, then the minimal proxy: prefill leg, decode1 leg."""
        before = by_source(self.decode1)
        for prompt in prompts:
            req = body(self.model, prompt)
            await self.quiet()
            plain_ms, _ = await attempt(one_token_ms(http, self.plain.url, req))
            await self.quiet()
            # The minimal proxy: prefill leg, then at once the decode leg.
            prefill_ms, err = await attempt(one_token_ms(http, self.prefill.url, req))
            got, err2 = (None, err) if err else await attempt(streamed(http, self.decode1.url, req))
            self.sample("a_decode1", prompt, plain_prefill_ms=plain_ms, prefill_ms=prefill_ms,
                        decode_ttft_ms=got and got["ttft_ms"],
                        decode_latency_ms=got and got["latency_ms"], error=err2,
                        equal=self.check(prompt, got))  # fmt: skip
            bar.update()
        settle()
        return delta(by_source(self.decode1), before)

    async def second_decode(self, http, prompts: list[list[int]], bar) -> dict:
        """(b): decode2 asked for the prompts (a) prefilled."""
        before = by_source(self.decode2)
        for prompt in prompts:
            await self.quiet()
            got, err = await attempt(streamed(http, self.decode2.url, body(self.model, prompt)))
            self.sample("b_decode2", prompt, decode_ttft_ms=got and got["ttft_ms"], error=err,
                        equal=self.check(prompt, got))  # fmt: skip
            bar.update()
        settle()
        return delta(by_source(self.decode2), before)

    async def prefix_reuse(self, http, system: list[int], suffixes: dict, bar) -> dict:
        """(d): the shared prefix prefilled once into the pool, then system + suffix to plain,
        decode2 (no prefix cache: the pool) and decode1 (its own prefix cache), in turn. Each
        target has suffixes of its own (same lengths), so no target finds another's suffix in
        the pool (decode2, kv_both, puts what it computes)."""
        await one_token_ms(http, self.prefill.url, body(self.model, system))
        settle()  # vLLM's connector puts in the background: give it time to land
        targets = {"plain": self.plain, "pool": self.decode2, "local_cache": self.decode1}
        before = {t: by_source(srv) for t, srv in targets.items()}
        for i in range(len(suffixes["plain"])):
            for target, srv in targets.items():
                prompt = system + suffixes[target][i]
                await self.quiet()
                got, err = await attempt(streamed(http, srv.url, body(self.model, prompt)))
                self.sample(f"d_{target}", prompt, ttft_ms=got and got["ttft_ms"], error=err,
                            equal=self.check(prompt, got))  # fmt: skip
            bar.update()
        settle()
        return {t: delta(by_source(srv), before[t]) for t, srv in targets.items()}

    def connector_metrics(self) -> dict[str, dict[str, float]]:
        out = {}
        for name in ("prefill", "decode1", "decode2"):
            m = getattr(self, name).metrics()
            out[name] = {k: v for k, v in m.items() if "mooncake" in k.lower()}
        return out


def share(d: dict[str, float]) -> float:
    total = sum(d.values())
    return d["external_kv_transfer"] / total if total else float("nan")


def write_config(path: Path, master: servers.MasterServer) -> Path:
    """The one json both connectors read (the keys Mooncake Store users write)."""
    path.write_text(json.dumps({
        "master_server_address": master.address,
        "metadata_server": master.metadata_url,
        "local_hostname": "127.0.0.1",
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": SEGMENT,
        "local_buffer_size": "64MB",  # vLLM's default is 4 GB per instance
    }, indent=1))  # fmt: skip
    return path


def stack_specs(connector: str, config: Path, lookup_ports: bool = True) -> list[ServerSpec]:
    env = {"MOONCAKE_CONFIG_PATH": str(config), "VLLM_LOG_STATS_INTERVAL": "1"}
    if connector == "vllm":
        env["MOONCAKE_REQUESTER_LOCAL_HOSTNAME"] = "127.0.0.1"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(WORKAROUND_DIR), os.environ.get("PYTHONPATH", "")) if p
        )
    specs = []
    for name in ("prefill", "decode1", "decode2"):
        kv: dict = {"kv_connector": KV_CONNECTOR[connector], "kv_role": "kv_both"}
        if connector == "vllm" and lookup_ports:
            kv["kv_connector_extra_config"] = {"lookup_rpc_port": servers.free_port()}
        args = ["--kv-transfer-config", json.dumps(kv)]
        if name == "decode2":
            args.append("--no-enable-prefix-caching")
        specs.append(ServerSpec(f"pool-{connector}-{name}", args=args, env=env))
    return specs


async def references(model: str, plain, prompts: list[list[int]]) -> dict:
    async with client_session() as http:
        out = {}
        for prompt in tqdm(prompts, desc="plain references", file=sys.stderr):
            out[tuple(prompt)] = (await streamed(http, plain.url, body(model, prompt)))["token_ids"]
        return out


async def warm_up(model: str, run: Run) -> None:
    rng = random.Random(99)
    async with client_session() as http:
        for srv in (run.prefill, run.decode1, run.decode2):
            for prompt in token_prompts(rng, 2, 100, 300):
                await complete(http, srv, body(model, prompt))


async def measure(run: Run, prompts, system, suffixes) -> dict:
    total = 2 * len(prompts) + len(suffixes["plain"])
    bar = tqdm(total=total, desc=run.connector, file=sys.stderr)
    async with client_session() as http:
        a = await run.handover(http, prompts, bar)
        b = await run.second_decode(http, prompts, bar)
        d = await run.prefix_reuse(http, system, suffixes, bar)
    bar.close()
    return {"a_decode1": a, "b_decode2": b, **{f"d_{t}": v for t, v in d.items()}}


def summarize(samples: list[dict], sources: dict[str, dict]) -> list[dict]:
    rows = []
    for c in CONNECTORS:
        if c not in sources:
            continue
        mine = [s for s in samples if s["connector"] == c]
        ab = [s for s in mine if s["phase"] in ("a_decode1", "b_decode2")]
        a = [s for s in mine if s["phase"] == "a_decode1"]
        plain_ms = [s["plain_prefill_ms"] for s in a if s["plain_prefill_ms"] is not None]
        pool_ms = [s["prefill_ms"] for s in a if s["prefill_ms"] is not None]
        cost = [s["prefill_ms"] - s["plain_prefill_ms"] for s in a
                if s["prefill_ms"] is not None and s["plain_prefill_ms"] is not None]  # fmt: skip
        rows.append({
            "table": "handover",
            "connector": c,
            "requests": len(ab),
            "failed": sum(1 for s in ab if s["error"]),
            "decode1_pool_%": 100 * share(sources[c]["a_decode1"]),
            "decode2_pool_%": 100 * share(sources[c]["b_decode2"]),
            "mismatched": sum(1 for s in ab if s["equal"] is False),
            "prefill_p50_ms": common.percentile(pool_ms, 50),
            "plain_p50_ms": common.percentile(plain_ms, 50),
            "save_cost_p50_ms": common.percentile(cost, 50),
            "save_cost_p90_ms": common.percentile(cost, 90),
            "decode1_ttft_p50_ms": common.percentile(
                [s["decode_ttft_ms"] for s in a if s["decode_ttft_ms"] is not None], 50),
        })  # fmt: skip
    for c in CONNECTORS:
        if c not in sources:
            continue
        for target in PREFIX_TARGETS:
            sel = [s for s in samples if s["connector"] == c and s["phase"] == f"d_{target}"]
            ttft = [s["ttft_ms"] for s in sel if s["ttft_ms"] is not None]
            rows.append({
                "table": "prefix_reuse",
                "connector": c,
                "target": target,
                "requests": len(sel),
                "failed": sum(1 for s in sel if s["error"]),
                "pool_%": 100 * share(sources[c][f"d_{target}"]),
                "mismatched": sum(1 for s in sel if s["equal"] is False),
                "ttft_p50_ms": common.percentile(ttft, 50),
                "ttft_p99_ms": common.percentile(ttft, 99),
            })  # fmt: skip
    return rows


def plot(rows: list[dict]):
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        hand = [r for r in rows if r["table"] == "handover"]
        pre = [r for r in rows if r["table"] == "prefix_reuse"]
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
        width, colors = 0.38, {"ours": "#1f77b4", "vllm": "#ff7f0e"}
        for i, r in enumerate(hand):
            xs = [j + (i - 0.5) * width for j in range(2)]
            ax1.bar(xs, [r["decode1_pool_%"], r["decode2_pool_%"]], width,
                    label=f"{r['connector']} ({r['failed']} failed)",
                    color=colors[r["connector"]])  # fmt: skip
        for j, target in enumerate(TARGETS.values()):
            ax1.hlines(100 * target, j - 0.45, j + 0.45, colors="k", linestyles="dashed")
        ax1.set_xticks([0, 1], ["decode1 (minimal proxy)", "decode2 (prefilled earlier)"])
        ax1.set_ylabel("% of prompt tokens from the pool")
        ax1.set_ylim(0, 105)
        ax1.set_title("vLLM's prompt_tokens_by_source (dashed: targets)")
        ax1.legend(loc="lower right")
        for i, r in enumerate(hand):
            xs = [j + (i - 0.5) * width for j in range(2)]
            ax2.bar(xs, [r["plain_p50_ms"], r["prefill_p50_ms"]], width, label=r["connector"],
                    color=colors[r["connector"]])  # fmt: skip
        ax2.set_xticks([0, 1], ["plain vLLM", "prefill saving to the pool"])
        ax2.set_ylabel("max_tokens=1 latency p50 (ms)")
        ax2.set_title("what saving costs prefill (same prompts)")
        ax2.legend()
        for i, c in enumerate(CONNECTORS):
            sel = [r for r in pre if r["connector"] == c]
            if not sel:
                continue
            xs = [j + (i - 0.5) * width for j in range(len(sel))]
            ax3.bar(xs, [r["ttft_p50_ms"] for r in sel], width, label=f"{c} p50",
                    color=colors[c])  # fmt: skip
            ax3.scatter(xs, [r["ttft_p99_ms"] for r in sel], color="k", marker="_", s=200,
                        label="p99" if i == 0 else None)  # fmt: skip
        labels = ["plain (computes all)", "decode2 (pool)", "decode1 (own cache)"]
        ax3.set_xticks(range(len(PREFIX_TARGETS)), labels)
        ax3.set_ylabel("TTFT (ms)")
        ax3.set_title(f"prefix reuse: {SYSTEM_TOKENS}-token shared system prompt")
        ax3.legend(loc="upper left", fontsize="small")
        common.save_figure(fig, path, "KV pool: ours vs vLLM's MooncakeStoreConnector (1P2D)")

    return draw


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=None, help="(a)/(b) prompts (quick 8, full 40)")
    ap.add_argument("--suffixes", type=int, default=None, help="(d) requests (quick 8, full 40)")
    ap.add_argument("--connectors", default=",".join(CONNECTORS), help="%(default)s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--quiet-s", type=float, default=QUIET_S, help="pause before timed requests (%(default)s)"
    )
    ap.add_argument(
        "--no-lookup-ports",
        action="store_true",
        help="vLLM's connector without a lookup_rpc_port per instance (as a new user starts it)",
    )
    args = ap.parse_args(argv)
    n_prompts = args.prompts or (40 if args.full else 8)
    n_suffixes = args.suffixes or (40 if args.full else 8)
    connectors = [c for c in args.connectors.split(",") if c]
    if unknown := set(connectors) - set(CONNECTORS):
        ap.error(f"--connectors: unknown {sorted(unknown)}; accepted: {CONNECTORS}")
    rng = random.Random(args.seed)
    prompts = token_prompts(rng, n_prompts, PROMPT_MIN, PROMPT_MAX)
    system = token_prompts(rng, 1, SYSTEM_TOKENS, SYSTEM_TOKENS)[0]
    lengths = [rng.randint(SUFFIX_MIN, SUFFIX_MAX) for _ in range(n_suffixes)]
    suffixes = {
        t: [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)] for n in lengths]
        for t in PREFIX_TARGETS
    }
    references_for = prompts + [system + x for t in PREFIX_TARGETS for x in suffixes[t]]
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-pool-"))
    log_dir = workdir / "logs"
    model = str(build_tiny_model())
    samples: list[dict] = []
    sources: dict[str, dict] = {}
    metrics: dict[str, dict] = {}
    started: list = []
    try:
        t0 = time.monotonic()
        plain_spec = ServerSpec("pool-plain", args=["--no-enable-prefix-caching"])
        plain = None
        for connector in connectors:
            master = servers.start_mooncake_master(log_dir=log_dir)
            started.append(master)
            config = write_config(workdir / f"{connector}.json", master)
            specs = stack_specs(connector, config, not args.no_lookup_ports) + (
                [plain_spec] if plain is None else []
            )
            stack = start_many(model, specs, timeout_s=1200, log_dir=log_dir)
            started += stack
            plain = plain or stack[3]
            print(f"{connector}: stack up at {time.monotonic() - t0:.0f}s", file=sys.stderr)
            if connector == connectors[0]:
                refs = asyncio.run(references(model, plain, references_for))
            run = Run(connector, model, plain, *stack[:3], refs, args.quiet_s)
            asyncio.run(warm_up(model, run))
            sources[connector] = asyncio.run(measure(run, prompts, system, suffixes))
            metrics[connector] = run.connector_metrics()
            samples += run.samples
            for srv in [*stack[:3], master]:
                srv.stop()
                started.remove(srv)
    finally:
        for s in reversed(started):
            s.stop()
        servers.stop_all()
    rows = summarize(samples, sources)
    settings = {
        "mode": "full" if args.full else "quick",
        "connectors": {c: KV_CONNECTOR[c] for c in connectors},
        "prompts": n_prompts, "prompt_tokens": [PROMPT_MIN, PROMPT_MAX],
        "system_tokens": SYSTEM_TOKENS, "suffixes": n_suffixes,
        "suffix_tokens": [SUFFIX_MIN, SUFFIX_MAX], "output_tokens": OUTPUT_TOKENS,
        "global_segment_size": SEGMENT, "seed": args.seed, "quiet_s": args.quiet_s,
        "vllm_lookup_rpc_port_per_instance": not args.no_lookup_ports,
        "stack": "mooncake_master + prefill + decode1 + decode2 (kv_both), tiny model; decode2 "
                 "--no-enable-prefix-caching; plain vLLM --no-enable-prefix-caching",
        "prompt_tokens_by_source": sources, "connector_metrics": metrics,
        "log_dir": str(log_dir),
    }  # fmt: skip
    notes = [
        "pool_%: delta of vllm:prompt_tokens_by_source_total{source=external_kv_transfer} over "
        "all sources, on the server the requests went to",
        "save_cost: prefill leg (max_tokens=1, saving to the pool) minus plain vLLM's "
        "max_tokens=1 latency on the same prompt, measured right before it",
        "stacks ran one after the other in the order of settings.connectors; plain throughout",
        "the minimal proxy is played by the client: prefill max_tokens=1, then decode",
    ]
    if "vllm" in connectors:
        notes.append(WORKAROUND_NOTE)
    paths = common.write_result(
        args.out_dir, "pool", settings=settings, samples=samples, rows=rows, notes=notes,
        plot=plot(rows),
    )  # fmt: skip
    hand = [{k: v for k, v in r.items() if k != "table"} for r in rows if r["table"] == "handover"]
    pre = [{k: v for k, v in r.items() if k != "table"} for r in rows if r["table"] != "handover"]
    common.report("pool: handover behind the minimal proxy, ours vs vLLM's", hand, [])
    common.report("pool: prefix reuse (shared system prompt), TTFT", pre, paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
