"""What disaggregation costs a client: plain vLLM vs our 1P1D (P2P, pool) vs vLLM's built-in 1P1D.

    python -m benchmarks.serving [--full] [--out-dir DIR] [--no-builtin] [--no-pool] [--mla]
                                 [--ours-b JSON] [--ours-b-src DIR] [--ours-b-proxy FLAGS]
                                 [--ours-proxy FLAGS]

Four setups of the tiny local model (``--mla``: the tiny DeepSeek-V2-style MLA model, served
with ``--attention-backend CPU_MLA``; results then go to ``serving_mla.json``/``.png``) on this
machine, started together and measured interleaved (a b c a b c ...) so drift hits all alike.
Each setup's batch starts after a pause (``--quiet-s``, 1.2 s): a vLLM worker busy-waits about a
second after each step (plain and the built-in pair keep vLLM's 1 s), which on 2 cores would slow
whichever setup is measured next:

- ``plain``: one vLLM server;
- ``ours``: prefill (127.0.0.2) + decode (127.0.0.3) with this package's MooncakeConnector
  (TCP, P2P handshake), behind our proxy (``mooncake_vllm.proxy.server``);
- ``pool``: prefill + decode (both ``kv_both``, 127.0.0.6 and 127.0.0.7) with this package's
  ``MooncakeStoreConnector`` on one ``mooncake_master``, behind our proxy in ``--mode pool``;
- ``builtin``: prefill (127.0.0.4) + decode (127.0.0.5) with vLLM's built-in MooncakeConnector
  (``VllmMooncakeConnector``), behind ``benchmarks.builtin_proxy`` (its docs' proxy protocol),
  its bootstrap server on 127.0.0.4 (``benchmarks.builtin_bootstrap``). **Runtime workaround**:
  its servers get ``benchmarks/builtin_cpu_workaround`` on ``PYTHONPATH``, a sitecustomize that
  makes ``torch.accelerator.current_device_index()`` answer 0 on CPU-only torch (that one call
  crashes its worker otherwise). vLLM's files are not modified.

Workload: seeded random token-id prompts of fixed lengths, 32 output tokens (``ignore_eos``),
greedy, streamed; a fixed number of requests per cell at concurrency 1 and 4. Client-side TTFT,
TPOT, ITL; KV transfer time per request from the connectors' own counters (ours: decode's
``mooncake_vllm:pull_duration_seconds``; pool: decode's ``mooncake_vllm:pool_get_duration_seconds``;
built-in: its "KV Transfer metrics" log lines).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from tqdm import tqdm

from benchmarks import common
from harness import servers
from harness.pd import ServerSpec, kv_args, mooncake_json, sse_events, start_many
from harness.tiny_model import MLA_CPU_ARGS, TinyMLASpec, TinyModelSpec, build_tiny_model

CONFIGS = ["plain", "ours", "ours_b", "pool", "builtin"]
OUTPUT_TOKENS = 32
VOCAB_LOW, VOCAB_HIGH = 10, 2000  # the tiny model's vocabulary is 2048 ids
WORKAROUND_DIR = Path(__file__).parent / "builtin_cpu_workaround"
WORKAROUND_NOTE = (
    "built-in connector servers ran with benchmarks/builtin_cpu_workaround on PYTHONPATH: a "
    "sitecustomize making torch.accelerator.current_device_index() return 0 on CPU-only torch "
    "(vLLM 0.32's built-in MooncakeConnector crashes there otherwise); vLLM's files unmodified"
)
OURS_P, OURS_D, BUILTIN_P, BUILTIN_D = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
POOL_P, POOL_D = "127.0.0.6", "127.0.0.7"
OURS_B_P, OURS_B_D = "127.0.0.8", "127.0.0.9"
MAX_MODEL_LEN = 2304
STATS_ENV = {"VLLM_LOG_STATS_INTERVAL": "1"}
# The MLA model's server flags on CPU (with the harness's --dtype float32): vLLM's reference MLA
# kernels; vLLM then uses 16-token blocks and turns prefix caching and chunked prefill off.


class Stack:
    """Every server of the three setups; ``stop()`` ends them all."""

    def __init__(
        self,
        with_builtin: bool,
        workdir: Path,
        log_dir: Path,
        spec: TinyModelSpec | TinyMLASpec,
        with_pool: bool = False,
        ours_b: dict | None = None,
        ours_b_src: Path | None = None,
        ours_b_proxy: Sequence[str] = (),
        ours_proxy: Sequence[str] = (),
    ):
        self.with_builtin, self.with_pool = with_builtin, with_pool
        self.ours_proxy = list(ours_proxy)  # flags of our pair's proxy
        self.ours_b_proxy = list(ours_b_proxy)  # flags of the second pair's proxy
        self.ours_b = ours_b  # settings of a second P2P pair measured beside ours (an A/B)
        self.ours_b_src = ours_b_src  # another checkout that pair runs mooncake_vllm from
        self.workdir, self.log_dir = workdir, log_dir
        self.spec = spec
        self.model_args = MLA_CPU_ARGS if isinstance(spec, TinyMLASpec) else []
        self.started: list = []
        self.urls: dict[str, str] = {}

    @classmethod
    def attach(cls, model: str, plain, prefill, decode, proxy_url: str, log_dir: Path) -> Stack:
        """Servers someone else started and stops (the test suite's shared cluster): plain and
        ours only."""
        stack = cls(False, log_dir, log_dir, TinyModelSpec())
        stack.model = model
        stack.vllm = {"plain": plain, "ours-prefill": prefill, "ours-decode": decode}
        stack.urls = {"plain": plain.url, "ours": proxy_url}
        return stack

    def start(self) -> None:
        model = str(build_tiny_model(spec=self.spec))
        self.model = model
        common_args = ["--max-model-len", str(MAX_MODEL_LEN), *self.model_args]
        cfg = mooncake_json(
            self.workdir / "mooncake.json",
            prefill_url=f"{OURS_P}:13003",
            decode_url=f"{OURS_D}:13012",
            # vLLM's built-in connector, run beside, binds 0.0.0.0:8998 for its own bootstrap.
            bootstrap_port=0,
        )
        ours_env = {"MOONCAKE_CONFIG_PATH": str(cfg), **STATS_ENV}
        prefill_args = [*common_args, *kv_args("kv_producer")]
        decode_args = [*common_args, *kv_args("kv_consumer", kv_load_failure_policy="recompute")]
        specs = [
            ServerSpec("plain", "127.0.0.1", common_args, STATS_ENV),
            ServerSpec("ours-prefill", OURS_P, prefill_args, ours_env),
            ServerSpec("ours-decode", OURS_D, decode_args, ours_env),
        ]
        if self.ours_b is not None:
            cfg_b = mooncake_json(
                self.workdir / "mooncake-b.json",
                prefill_url=f"{OURS_B_P}:13003",
                decode_url=f"{OURS_B_D}:13012",
                **self.ours_b,
            )
            env_b = {"MOONCAKE_CONFIG_PATH": str(cfg_b), **STATS_ENV}
            src = self.ours_b_src
            specs += [
                ServerSpec("ours_b-prefill", OURS_B_P, prefill_args, env_b, cwd=src),
                ServerSpec("ours_b-decode", OURS_B_D, decode_args, env_b, cwd=src),
            ]
        if self.with_pool:
            master = servers.start_mooncake_master(log_dir=self.log_dir)
            self.started.append(master)
            specs += [
                self._pool_spec("pool-prefill", POOL_P, master),
                self._pool_spec("pool-decode", POOL_D, master),
            ]
        if self.with_builtin:
            bootstrap_port = servers.free_port(BUILTIN_P)
            self.bootstrap_url = f"http://{BUILTIN_P}:{bootstrap_port}"
            boot = servers.ManagedProcess(
                "builtin-bootstrap",
                [sys.executable, "-m", "benchmarks.builtin_bootstrap", "--host", BUILTIN_P,
                 "--port", str(bootstrap_port)],
                self.log_dir / "builtin-bootstrap.log",
            ).start()  # fmt: skip
            self.started.append(boot)
            boot.wait_until(
                lambda: servers.http_json(f"{self.bootstrap_url}/query") is not None,
                120,
                "serving /query",
            )
            specs += [
                self._builtin_spec("builtin-prefill", BUILTIN_P, "kv_producer", bootstrap_port),
                self._builtin_spec("builtin-decode", BUILTIN_D, "kv_consumer", bootstrap_port),
            ]
        started = start_many(model, specs, timeout_s=1200, log_dir=self.log_dir)
        self.started += started
        self.vllm = {s.name: srv for s, srv in zip(specs, started, strict=True)}
        self.urls["plain"] = self.vllm["plain"].url
        self.urls["ours"] = self._our_proxy("ours", *self.ours_proxy)
        if self.ours_b is not None:
            self.urls["ours_b"] = self._our_proxy("ours_b", *self.ours_b_proxy)
        if self.with_pool:
            self.urls["pool"] = self._our_proxy("pool", "--mode", "pool")
        if self.with_builtin:
            self.urls["builtin"] = self._proxy(
                "builtin-proxy",
                ["benchmarks.builtin_proxy", "--prefill", self.vllm["builtin-prefill"].url,
                 "--decode", self.vllm["builtin-decode"].url, "--bootstrap", self.bootstrap_url],
            )  # fmt: skip

    def _pool_spec(self, name: str, host: str, master) -> ServerSpec:
        cfg = {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            # As for ours: a failed get is computed again (and counted), not a failed request.
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "master_server_address": master.address,
                "metadata_server": master.metadata_url,
                "local_hostname": host,
                "global_segment_size": "1GB",
            },
        }
        args = ["--max-model-len", str(MAX_MODEL_LEN), *self.model_args]
        args += ["--kv-transfer-config", json.dumps(cfg)]
        return ServerSpec(name, host, args, STATS_ENV)

    def _builtin_spec(self, name: str, host: str, role: str, bootstrap_port: int) -> ServerSpec:
        cfg = {
            "kv_connector": "VllmMooncakeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {
                "mooncake_protocol": "tcp",
                "bootstrap_server_address": f"{BUILTIN_P}:{bootstrap_port}",
            },
        }
        pythonpath = os.pathsep.join(
            p for p in (str(WORKAROUND_DIR), os.environ.get("PYTHONPATH", "")) if p
        )
        env = {
            "PYTHONPATH": pythonpath,
            "VLLM_HOST_IP": host,
            "MC_FORCE_TCP": "1",
            "MC_TCP_BIND_ADDRESS": host,
            **STATS_ENV,
        }
        args = ["--max-model-len", str(MAX_MODEL_LEN), *self.model_args]
        args += ["--kv-transfer-config", json.dumps(cfg)]
        return ServerSpec(name, host, args, env)

    def _our_proxy(self, setup: str, *flags: str) -> str:
        """Our proxy in front of ``{setup}-prefill`` and ``{setup}-decode``."""
        return self._proxy(
            f"{setup}-proxy",
            ["mooncake_vllm.proxy.server", *flags, "--prefill", self.vllm[f"{setup}-prefill"].url,
             "--decode", self.vllm[f"{setup}-decode"].url, "--log-level", "warning"],
        )  # fmt: skip

    def _proxy(self, name: str, argv: list[str]) -> str:
        port = servers.free_port()
        url = f"http://127.0.0.1:{port}"
        proc = servers.ManagedProcess(
            name, [sys.executable, "-m", *argv, "--port", str(port)], self.log_dir / f"{name}.log"
        ).start()
        self.started.append(proc)
        proc.wait_until(lambda: servers.http_text(f"{url}/health") is not None, 60, "healthy")
        return url

    def stop(self) -> None:
        for s in reversed(self.started):
            s.stop()
        servers.stop_all()


# ---- one request, streamed ----------------------------------------------------------------------


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    arrivals: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for event in sse_events(resp):
            if any(c.get("text") for c in event.get("choices", [])):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    if not arrivals:
        raise RuntimeError(f"{url}: no tokens streamed")
    ttft = arrivals[0] - t0
    itls = [b - a for a, b in itertools.pairwise(arrivals)]
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else 0.0
    return {
        "ttft_ms": ttft * 1000,
        "tpot_ms": tpot * 1000,
        "itl_ms": [x * 1000 for x in itls],
        "latency_ms": (end - t0) * 1000,
        "chunks": len(arrivals),
    }


async def run_batch(url: str, model: str, prompts: list[list[int]], concurrency: int):
    """``prompts`` through ``url`` with at most ``concurrency`` in flight; (results, wall s)."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def go(i, p):
            async with sem:
                try:
                    return {"index": i, **await one_request(session, url, model, p)}
                except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                    # Recorded, not fatal: one failed request must not lose the whole sweep.
                    return {"index": i, "error": str(e)[:500]}

        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(i, p) for i, p in enumerate(prompts)))
        return results, time.perf_counter() - t0


def idle_pulls(stack: Stack, tokens: int, n: int, seed: int) -> list[float]:
    """Our read time (ms, decode's own histogram) of ``n`` single requests through an otherwise idle
    pair, each after a pause that lets vLLM's post-step busy-wait end."""
    d = stack.vllm["ours-decode"]
    out = []
    for prompt in make_prompts(tokens, n, seed + 7):
        time.sleep(2.5)
        s0 = d.metric("mooncake_vllm:read_duration_seconds_sum")
        c0 = d.metric("mooncake_vllm:read_duration_seconds_count")
        asyncio.run(run_batch(stack.urls["ours"], stack.model, [prompt], 1))
        deadline = time.monotonic() + 10
        while d.metric("mooncake_vllm:read_duration_seconds_count") == c0:
            if time.monotonic() > deadline:
                raise RuntimeError("decode reported no pull for an idle-pair request")
            time.sleep(0.25)
        out.append(1000 * (d.metric("mooncake_vllm:read_duration_seconds_sum") - s0))
    return out


# ---- the connectors' own counters ---------------------------------------------------------------

_BUILTIN_LINE = re.compile(
    r"KV Transfer metrics: Num successful transfers=(\d+), Avg xfer time \(ms\)=([\d.]+),"
    r".*?Avg MB per transfer=([\d.]+)"
)


def ours_counters(stack: Stack, decode: str = "ours-decode") -> dict:
    d = stack.vllm[decode]
    return {
        "transfers": d.metric("mooncake_vllm:pulls_total"),
        "seconds": d.metric("mooncake_vllm:pull_duration_seconds_sum"),
        "bytes": d.metric("mooncake_vllm:bytes_total"),
        "failures": d.metric("mooncake_vllm:pull_failures_total"),
        "retries": d.metric("mooncake_vllm:retries_total"),
        "stalls": d.metric("mooncake_vllm:stalls_total"),
        "layered": d.metric("mooncake_vllm:layered_total"),
        "acquire_seconds": d.metric("mooncake_vllm:acquire_duration_seconds_sum"),
        "read_seconds": d.metric("mooncake_vllm:read_duration_seconds_sum"),
        "acquire_buckets": d.histogram("mooncake_vllm:acquire_duration_seconds"),
    }


def pool_counters(stack: Stack) -> dict:
    d = stack.vllm["pool-decode"]
    return {
        "transfers": d.metric("mooncake_vllm:pool_loads_total"),
        "seconds": d.metric("mooncake_vllm:pool_get_duration_seconds_sum"),
        "bytes": d.metric("mooncake_vllm:pool_get_bytes_total"),
        "failures": d.metric("mooncake_vllm:pool_load_failures_total"),
        "retries": d.metric("mooncake_vllm:pool_get_retries_total"),
    }


def builtin_counters(stack: Stack) -> dict:
    """Totals over the built-in producer's "KV Transfer metrics" log lines so far."""
    text = stack.vllm["builtin-prefill"].process.log_path.read_text(errors="replace")
    n = secs = nbytes = 0.0
    for m in _BUILTIN_LINE.finditer(text):
        k = int(m.group(1))
        n += k
        secs += k * float(m.group(2)) / 1000
        nbytes += k * float(m.group(3)) * 2**20
    return {"transfers": n, "seconds": secs, "bytes": nbytes}


def leg_counters(stack: Stack, first: str, second: str | None) -> dict:
    """Server-side time of each leg so far, from vLLM's own histograms (sums and counts): the
    first server's whole request (plain alone: its TTFT), the second server's TTFT (a decode's
    arrival to first token, its KV load included)."""
    one = stack.vllm[first].metrics()
    if second is None:
        return _sums_and_counts([("leg1", one, "vllm:time_to_first_token_seconds")])
    two = stack.vllm[second].metrics()
    return _sums_and_counts(
        [
            ("leg1", one, "vllm:e2e_request_latency_seconds"),
            ("leg2", two, "vllm:time_to_first_token_seconds"),
            # The decode's engine core: queued to scheduled (the KV load is in it), then
            # scheduled to first token (computing the prompt's rest); counted when it finishes.
            ("q2", two, "vllm:request_queue_time_seconds"),
            ("pf2", two, "vllm:request_prefill_time_seconds"),
        ]
    )


def _sums_and_counts(histograms) -> dict:
    """``{key}_s`` and ``{key}_n`` of each (key, metric totals, histogram name)."""
    out = {}
    for key, totals, name in histograms:
        out[f"{key}_s"] = totals.get(f"{name}_sum", 0.0)
        out[f"{key}_n"] = totals.get(f"{name}_count", 0.0)
    return out


def proxy_counters(stack: Stack, setup: str) -> dict:
    """Our proxy's view of the same so far (sums and counts): sending the prefill request to
    having its whole answer; the client's request arriving to the decode answer's first byte."""
    totals = servers.metric_totals(f"{stack.urls[setup]}/metrics")
    return _sums_and_counts(
        [
            ("px1", totals, "mooncake_proxy_prefill_seconds"),
            ("pxf", totals, "mooncake_proxy_time_to_first_decode_byte_seconds"),
        ]
    )


def counters(stack: Stack) -> dict[str, dict]:
    out = {
        "plain": leg_counters(stack, "plain", None),
        "ours": {
            **ours_counters(stack),
            **leg_counters(stack, "ours-prefill", "ours-decode"),
            **proxy_counters(stack, "ours"),
        },
    }
    if stack.ours_b is not None:
        out["ours_b"] = {
            **ours_counters(stack, "ours_b-decode"),
            **leg_counters(stack, "ours_b-prefill", "ours_b-decode"),
            **proxy_counters(stack, "ours_b"),
        }
    if stack.with_pool:
        out["pool"] = {
            **pool_counters(stack),
            **leg_counters(stack, "pool-prefill", "pool-decode"),
            **proxy_counters(stack, "pool"),
        }
    if stack.with_builtin:
        out["builtin"] = {
            **builtin_counters(stack),
            **leg_counters(stack, "builtin-prefill", "builtin-decode"),
        }
    return out


# ---- the sweep ----------------------------------------------------------------------------------


def make_prompts(length: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"{seed}-{length}")
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)] for _ in range(n)]


def sweep(
    stack: Stack, lengths, concurrencies, requests: int, rounds: int, seed: int, quiet_s: float
):
    configs = [c for c in CONFIGS if c in stack.urls]
    samples, cells = [], []
    total = len(lengths) * len(concurrencies) * rounds * len(configs)
    bar = tqdm(total=total, desc="serving batches", file=sys.stderr)
    # Warm-up: every setup compiles and allocates on its first requests, and a connector meets its
    # peer on its first transfer (prompts longer than a block, so KV does move).
    for c in configs:
        asyncio.run(run_batch(stack.urls[c], stack.model, make_prompts(300, 3, seed + 99), 1))
    try:
        for length in lengths:
            for conc in concurrencies:
                per_round = max(1, requests // rounds)
                time.sleep(1.5)  # let the servers publish the last step's connector stats
                before = counters(stack)
                for r in range(rounds):
                    # Fresh prompts per round (no prefix-cache hits), the same for every setup.
                    prompts = make_prompts(length, per_round, seed * 1000 + r * 7 + conc)
                    for c in configs:
                        time.sleep(quiet_s)  # the previous setup's workers stop busy-waiting
                        results, wall_s = asyncio.run(
                            run_batch(stack.urls[c], stack.model, prompts, conc)
                        )
                        ok = [x for x in results if "error" not in x]
                        for res in results:
                            samples.append(
                                {"config": c, "prompt_tokens": length, "concurrency": conc,
                                 "round": r, **res}
                            )  # fmt: skip
                        cells.append(
                            {"config": c, "prompt_tokens": length, "concurrency": conc,
                             "round": r, "wall_s": wall_s, "requests": len(ok),
                             "errors": len(results) - len(ok),
                             "output_tokens": sum(x["chunks"] for x in ok)}
                        )  # fmt: skip
                        bar.update()
                time.sleep(1.5)
                after = counters(stack)
                for c, a in after.items():
                    b = before[c]
                    delta = {k: a[k] - b[k] for k in a if not k.endswith("_buckets")}
                    if "acquire_buckets" in a:
                        delta["acquire_p99_s"] = servers.histogram_quantile(
                            b["acquire_buckets"], a["acquire_buckets"], 0.99
                        )
                        delta["acquires_over_5ms"] = servers.histogram_count_above(
                            b["acquire_buckets"], a["acquire_buckets"], 0.005
                        )
                    cells.append(
                        {"config": c, "prompt_tokens": length, "concurrency": conc,
                         "kind": "kv_counters", **delta}
                    )  # fmt: skip
    finally:
        bar.close()
    return samples, cells


def summarize(samples: list[dict], cells: list[dict]) -> list[dict]:
    rows = []
    keys = sorted({(s["prompt_tokens"], s["concurrency"]) for s in samples})
    for length, conc in keys:
        base = {}
        for c in CONFIGS:
            sel = [
                s for s in samples
                if (s["config"], s["prompt_tokens"], s["concurrency"]) == (c, length, conc)
                and "error" not in s
            ]  # fmt: skip
            if not sel:
                continue
            batches = [
                x for x in cells
                if x.get("kind") is None
                and (x["config"], x["prompt_tokens"], x["concurrency"]) == (c, length, conc)
            ]  # fmt: skip
            kv = next(
                (x for x in cells if x.get("kind") == "kv_counters"
                 and (x["config"], x["prompt_tokens"], x["concurrency"]) == (c, length, conc)),
                None,
            )  # fmt: skip
            ttft = [s["ttft_ms"] for s in sel]
            itl = [x for s in sel for x in s["itl_ms"]]
            row = {
                "prompt": length,
                "conc": conc,
                "config": c,
                "n": len(sel),
                "ttft_p50": common.percentile(ttft, 50),
                "ttft_p90": common.percentile(ttft, 90),
                "ttft_p99": common.percentile(ttft, 99),
                "tpot_p50": common.percentile([s["tpot_ms"] for s in sel], 50),
                "itl_p50": common.percentile(itl, 50),
                "itl_p90": common.percentile(itl, 90),
                "itl_p99": common.percentile(itl, 99),
                "tok/s": sum(b["output_tokens"] for b in batches)
                / sum(b["wall_s"] for b in batches),
                "kv_ms/req": float("nan"),
                "kv_MB/req": float("nan"),
                "kv_B/tok": float("nan"),
                "kv_GB/s": float("nan"),
                "failed": float("nan"),
                "retries": float("nan"),
                "acq_p99_ms": float("nan"),
                "acq>5ms": float("nan"),
                "leg1_ms": float("nan"),
                "leg2_ms": float("nan"),
                "q2_ms": float("nan"),
                "pf2_ms": float("nan"),
                "px1_ms": float("nan"),
                "pxf_ms": float("nan"),
            }
            # Server-side means: where the TTFT goes (the rest is the proxy and HTTP).
            for key in ("leg1", "leg2", "q2", "pf2", "px1", "pxf"):
                if kv and kv.get(f"{key}_n"):
                    row[f"{key}_ms"] = 1000 * kv[f"{key}_s"] / kv[f"{key}_n"]
            if kv and "failures" in kv:  # ours and pool: failed loads (recomputed), retries
                row["failed"] = kv["failures"]
                row["retries"] = kv["retries"]
            if kv and "acquire_p99_s" in kv:
                row["acq_p99_ms"] = 1000 * kv["acquire_p99_s"]
                row["acq>5ms"] = kv["acquires_over_5ms"]
            if kv and kv.get("transfers", 0) > 0:
                row["kv_ms/req"] = kv["seconds"] * 1000 / kv["transfers"]
                row["kv_MB/req"] = kv["bytes"] / 1e6 / kv["transfers"]
                # Whole blocks move: the last one may be partly filled.
                row["kv_B/tok"] = kv["bytes"] / kv["transfers"] / length
                row["kv_GB/s"] = (
                    kv["bytes"] / kv["seconds"] / 1e9 if kv["seconds"] else float("nan")
                )
            base[c] = row
            rows.append(row)
        plain, builtin = base.get("plain"), base.get("builtin")
        for row in (base.get(c) for c in CONFIGS):
            if row is None:
                continue
            row["ttft/plain"] = row["ttft_p50"] / plain["ttft_p50"] if plain else float("nan")
            row["ttft/builtin"] = row["ttft_p50"] / builtin["ttft_p50"] if builtin else float("nan")
            row["overhead_ms"] = row["ttft_p50"] - plain["ttft_p50"] if plain else float("nan")
    return rows


def plot(rows: list[dict], model_label: str):
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        concs = sorted({r["conc"] for r in rows})
        fig, axes = plt.subplots(1, len(concs) + 1, figsize=(5.2 * (len(concs) + 1), 4.2))
        colors = {"plain": "#7f7f7f", "ours": "#1f77b4", "ours_b": "#9467bd", "pool": "#2ca02c",
                  "builtin": "#ff7f0e"}  # fmt: skip

        def series(ax, sel: list[dict], y: str, config: str) -> None:
            if sel:
                xs, ys = [r["prompt"] for r in sel], [r[y] for r in sel]
                ax.plot(xs, ys, "-o", color=colors[config], label=config)

        def panel(ax, configs, conc: int, y: str, ylabel: str, title: str) -> None:
            for c in configs:
                series(ax, [r for r in rows if r["config"] == c and r["conc"] == conc], y, c)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()

        for ax, conc in zip(axes, concs, strict=False):
            panel(ax, CONFIGS, conc, "ttft_p50", "TTFT p50 (ms)", f"TTFT, concurrency {conc}")
        kv_title = f"KV transfer time, concurrency {concs[0]}"
        kv_label = "KV transfer per request (ms, own counters)"
        kv_configs = ("ours", "ours_b", "pool", "builtin")
        panel(axes[-1], kv_configs, concs[0], "kv_ms/req", kv_label, kv_title)
        common.save_figure(
            fig, path, f"{model_label}, CPU, 1P1D over TCP loopback vs one plain vLLM"
        )

    return draw


def record(out_dir: Path, stack: Stack, settings: dict, samples: list, cells: list) -> None:
    """Summarize, write JSON and PNG, print notes and the table."""
    rows = summarize(samples, cells)
    mla = isinstance(stack.spec, TinyMLASpec)
    model_label = "tiny MLA model" if mla else "tiny model"
    notes = [
        "TTFT/ITL/TPOT measured by the client through each setup's front door (proxy or server)",
        f"{model_label} {stack.spec.name}: {stack.spec.kv_bytes_per_token} B of KV per token"
        + (f"; server flags {' '.join(MLA_CPU_ARGS)} (block size 16)" if mla else ""),
    ]
    notes.append(
        "leg1_ms/leg2_ms: server-side means from vLLM's own histograms; plain: its TTFT; a pair: "
        "its prefill's whole request (max_tokens=1) and its decode's TTFT (arrival to first "
        "token, the KV load included); the rest of a TTFT is the proxy and HTTP; q2_ms/pf2_ms: "
        "the decode engine core's queue time (arrival to scheduled, the KV load included) and "
        "prefill time (scheduled to first token); px1_ms/pxf_ms: our proxy's means, sending the "
        "prefill request to having its answer, and the client's request to decode's first byte"
    )
    if stack.with_builtin:
        notes.append(WORKAROUND_NOTE)
    if stack.ours_proxy:
        notes.append(f"ours: its proxy runs with {shlex.join(stack.ours_proxy)}")
    if stack.ours_b is not None:
        notes.append(
            f"ours_b: a second P2P pair ({OURS_B_P}, {OURS_B_D}) whose mooncake.json adds "
            f"{json.dumps(stack.ours_b)}, measured interleaved with ours"
            + (f"; it runs mooncake_vllm from {stack.ours_b_src}" if stack.ours_b_src else "")
        )
    if stack.with_pool:
        notes.append(
            "pool: kv_ms/req is decode's get time per load from the pool; the prefill's puts "
            "(before its answer leaves) are inside pool's TTFT"
        )
    settings = {
        **settings,
        "model": stack.spec.name,
        "kv_bytes_per_token": stack.spec.kv_bytes_per_token,
        "output_tokens": OUTPUT_TOKENS,
        "configs": [c for c in CONFIGS if c in stack.urls],
    }
    paths = common.write_result(
        out_dir, "serving_mla" if mla else "serving", settings=settings,
        samples=samples + cells, rows=rows, notes=notes, plot=plot(rows, model_label),
    )  # fmt: skip
    for note in notes:
        print(f"note: {note}")
    title = f"serving, {model_label}: plain vs ours (P2P, pool) vs built-in (TTFT/TPOT/ITL in ms)"
    common.report(title, rows, paths)


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=None, help="prompt lengths")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--requests", type=int, default=None, help="per cell and setup")
    ap.add_argument("--rounds", type=int, default=None, help="interleaving rounds per cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-builtin", action="store_true", help="skip vLLM's built-in connector")
    ap.add_argument("--no-pool", action="store_true", help="skip our pool mode")
    ap.add_argument("--mla", action="store_true", help="the tiny MLA model instead of the Llama")
    ap.add_argument(
        "--quiet-s",
        type=float,
        default=1.2,
        help="pause before each setup's batch, so the last one's busy-waiting workers are idle",
    )
    ap.add_argument(
        "--ours-b",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="an A/B: a second P2P pair whose mooncake.json adds these settings, measured "
        "interleaved with ours, e.g. '{\"gil_switch_interval_s\": null}' (with --no-pool: "
        "seven vLLMs fit in 24 GiB)",
    )
    ap.add_argument(
        "--ours-b-src",
        type=lambda p: Path(p).resolve(),
        default=None,
        metavar="DIR",
        help="an A/B of code: the second P2P pair runs mooncake_vllm from this checkout (e.g. a "
        "git worktree of the commit before a change); implies --ours-b '{}' if not given",
    )
    ap.add_argument(
        "--ours-b-proxy",
        type=shlex.split,
        default=[],
        metavar="FLAGS",
        help="an A/B of the proxy: the second P2P pair's proxy gets these flags, e.g. "
        "'--dispatch concurrent'; implies --ours-b '{}' if not given",
    )
    ap.add_argument(
        "--ours-proxy",
        type=shlex.split,
        default=[],
        metavar="FLAGS",
        help="flags of our pair's proxy, e.g. '--dispatch concurrent' for an A/B of pair "
        "settings under concurrent dispatch",
    )
    args = ap.parse_args(argv)
    if args.ours_b_proxy and args.ours_b is None:
        args.ours_b = {}
    if args.ours_b_src is not None:
        if not (args.ours_b_src / "mooncake_vllm").is_dir():
            ap.error(f"--ours-b-src {args.ours_b_src}: no mooncake_vllm package there")
        args.ours_b = {} if args.ours_b is None else args.ours_b
    lengths = args.lengths or ([256, 1024, 2048] if args.full else [256, 1024])
    requests = args.requests or (24 if args.full else 8)
    rounds = args.rounds or (4 if args.full else 2)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-serving-"))
    log_dir = workdir / "logs"
    spec = TinyMLASpec() if args.mla else TinyModelSpec()
    stack = Stack(
        not args.no_builtin,
        workdir,
        log_dir,
        spec,
        with_pool=not args.no_pool,
        ours_b=args.ours_b,
        ours_b_src=args.ours_b_src,
        ours_b_proxy=args.ours_b_proxy,
        ours_proxy=args.ours_proxy,
    )
    print(
        f"starting servers (logs in {log_dir}); vLLM takes minutes to start on 2 cores", flush=True
    )
    try:
        t0 = time.monotonic()
        stack.start()
        print(f"servers up after {time.monotonic() - t0:.0f} s", flush=True)
        samples, cells = sweep(
            stack, lengths, args.concurrency, requests, rounds, args.seed, args.quiet_s
        )
        idle_ms = idle_pulls(stack, max(lengths), 5, args.seed)
    finally:
        stack.stop()
    print(f"idle pair: {max(lengths)}-token pulls read in {[round(x, 1) for x in idle_ms]} ms")
    settings = {
        "mode": "full" if args.full else "quick",
        "lengths": lengths,
        "concurrency": args.concurrency,
        "requests_per_cell": requests,
        "rounds": rounds,
        "quiet_s": args.quiet_s,
        "seed": args.seed,
        "log_dir": str(log_dir),
        "idle_pair_read_ms": idle_ms,
        "ours_b": args.ours_b,
        "ours_b_src": str(args.ours_b_src) if args.ours_b_src else None,
        "ours_b_proxy": args.ours_b_proxy,
        "ours_proxy": args.ours_proxy,
    }
    record(args.out_dir, stack, settings, samples, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
