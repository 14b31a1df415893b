"""The pool as a new user lays it out: three ``MooncakeStoreConnector`` engines (``kv_both``), each
on its own address with its own ``MOONCAKE_CONFIG_PATH`` json of the keys Mooncake Store users
write, a ``mooncake_master`` started as the README starts it (its http metadata server,
``--client_ttl 30``), a plain vLLM to compare with, and requests the way of the minimal proxy
(prefill with ``max_tokens=1``, then the original request to decode 1; no
``kv_transfer_params``). Decode 2 then gets the same
prompts: it has seen none of them, so they must come from the pool.

    python -m harness.pool_hosts [--runs N] [--requests 12] [--client-ttl S] [--fresh]

Prints, per run: answers token-equal to plain, decode 1's prompt tokens by transfer, decode 2's
share from the pool, and the pool's failure counters. Exit 1 if any run misses its marks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from harness.pd import (
    POOL_COUNTERS,
    ServerSpec,
    client_session,
    complete,
    greedy_body,
    minimal_proxy,
    pool_args,
    reference_spec,
    start_many,
    start_with_master,
    tokens_by_transfer,
)
from harness.servers import MasterServer, VllmServer, start_mooncake_master
from harness.tiny_model import build_tiny_model

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
MAX_TOKENS = 8


def user_json(path: Path, host: str, master: MasterServer) -> Path:
    """The json of Mooncake's store guide, for the engine on ``host``."""
    cfg = {
        "local_hostname": host,
        "metadata_server": master.metadata_url,
        "master_server_address": master.address,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": 256 << 20,
        "local_buffer_size": 64 << 20,
    }
    path.write_text(json.dumps(cfg, indent=2))
    return path


def user_master(log_dir: Path | None = None, client_ttl_s: int = 30) -> MasterServer:
    """``mooncake_master`` as the README starts it (``--client_ttl 30``; the master's own
    default is 10 s, docs/pool.md "Threads")."""
    ttl = ["--client_ttl", str(client_ttl_s)]
    return start_mooncake_master(log_dir=log_dir, extra_args=ttl)


def start_pool_trio(
    model: str, tag: str, cfg_dir: Path, host: str = "127.0.0.1", args: Sequence[str] = ()
) -> tuple[MasterServer, dict[str, VllmServer]]:
    """A pool on one address as the store guide starts it: ``mooncake_master``, a plain vLLM
    (``plain``) and two ``kv_both`` instances of our pool connector (``prefill``, ``decode``),
    each with the guide's json under ``cfg_dir``; ``args`` on all three (LoRA modules, ...).
    If they do not all start, the master stops too."""
    master = user_master()

    def engine(name: str) -> ServerSpec:
        env = {"MOONCAKE_CONFIG_PATH": str(user_json(cfg_dir / f"{name}.json", host, master))}
        return ServerSpec(name, host, [*args, *pool_args("kv_both", {})], env)

    specs = [reference_spec(f"plain-{tag}", host, args), engine(f"{tag}-prefill"),
             engine(f"{tag}-decode")]  # fmt: skip
    started = start_with_master(model, master, specs)
    return master, dict(zip(("plain", "prefill", "decode"), started, strict=True))


# What ``vllm serve`` does when nothing is set: its CPU worker binds its OpenMP threads to the
# cores it picks (the harness's servers otherwise run unbound with one OpenMP thread each).
VLLM_DEFAULTS = {"VLLM_CPU_OMP_THREADS_BIND": "auto", "OMP_NUM_THREADS": str(os.cpu_count())}


def engine_specs(
    master: MasterServer, cfg_dir: Path, env: dict[str, str] | None = None
) -> list[ServerSpec]:
    kv = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"})
    names = ("pool-prefill", "pool-decode1", "pool-decode2")
    return [
        ServerSpec(
            name,
            host,
            ["--kv-transfer-config", kv],
            {
                "MOONCAKE_CONFIG_PATH": str(user_json(cfg_dir / f"{name}.json", host, master)),
                **(env or {}),
            },
        )
        for name, host in zip(names, HOSTS, strict=True)
    ]


@dataclass
class RunResult:
    requests: int
    equal: int
    decode1_share: float
    decode2_share: float
    failures: dict[str, float]

    def ok(self, decode1_min: float = 0.95, decode2_min: float = 0.90) -> bool:
        return (
            self.equal == self.requests
            and self.decode1_share >= decode1_min
            and self.decode2_share >= decode2_min
            and not any(self.failures.values())
        )

    def line(self) -> str:
        return (
            f"{self.equal} of {self.requests} token-equal; decode 1 by transfer "
            f"{100 * self.decode1_share:.1f} %; decode 2 from the pool "
            f"{100 * self.decode2_share:.1f} %; failures {self.failures}"
        )


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(rng.randint(200, 1400))] for _ in range(count)]


async def one_run(
    model: str,
    plain: VllmServer,
    prefill: VllmServer,
    decode1: VllmServer,
    decode2: VllmServer,
    seed: int,
    count: int = 12,
) -> RunResult:
    body = partial(greedy_body, model, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = prompts(seed, count)
    total = sum(len(p) for p in batch)
    before = {s: POOL_COUNTERS.read(s) for s in (prefill, decode1, decode2)}
    ext1, ext2 = tokens_by_transfer(decode1), tokens_by_transfer(decode2)
    equal = 0
    async with client_session() as http:
        refs = [await complete(http, plain, body(p)) for p in batch]
        for i, (p, ref) in enumerate(zip(batch, refs, strict=True)):
            try:
                got = await minimal_proxy(http, prefill, decode1, body(p, stream=i % 2 == 1))
                equal += got.token_ids == ref.token_ids
            except Exception as e:  # counted as not equal; the counters say why
                print(f"  decode 1, prompt {i}: {e}", file=sys.stderr)
        for i, (p, ref) in enumerate(zip(batch, refs, strict=True)):
            try:
                got = await complete(http, decode2, body(p))
                equal += got.token_ids == ref.token_ids
            except Exception as e:
                print(f"  decode 2, prompt {i}: {e}", file=sys.stderr)
    await asyncio.sleep(0.5)  # vLLM publishes a step's counters a moment after its output
    failures = {}
    for srv in (prefill, decode1, decode2):
        moved = POOL_COUNTERS.since(srv, before[srv])
        failures[f"{srv.process.name}.load_failures"] = moved["load_failures"]
        failures[f"{srv.process.name}.put_failures"] = moved["put_failures"]
    return RunResult(
        2 * count,
        equal,
        (tokens_by_transfer(decode1) - ext1) / total,
        (tokens_by_transfer(decode2) - ext2) / total,
        failures,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--requests", type=int, default=12, help="prompts per run")
    ap.add_argument(
        "--client-ttl", type=int, default=30, help="mooncake_master --client_ttl (its default: 10)"
    )
    ap.add_argument(
        "--harness-threads", action="store_true",
        help="the harness's unbound single-threaded vLLMs, not vLLM's default core binding",
    )  # fmt: skip
    ap.add_argument(
        "--fresh", action="store_true",
        help="a new master and new engines for every run, requests sent the moment they are up "
        "(the plain vLLM stays): the pool's stalled gets came in the first seconds",
    )  # fmt: skip
    args = ap.parse_args()
    model = str(build_tiny_model())
    work = Path(tempfile.mkdtemp(prefix="mooncake-vllm-pool-hosts-"))
    env = None if args.harness_threads else VLLM_DEFAULTS
    (plain,) = start_many(model, [reference_spec("plain")])
    bad, pool = 0, None
    try:
        for run in range(args.runs):
            if pool is None or args.fresh:
                log_dir = work / f"run{run + 1}" / "logs"
                master = user_master(log_dir, args.client_ttl)
                t0 = time.monotonic()
                engines = start_with_master(model, master, engine_specs(master, work, env))
                pool = (master, engines)
                print(f"started in {time.monotonic() - t0:.0f} s; logs in {log_dir} and the "
                      "engines' in the harness's log directory", flush=True)  # fmt: skip
            prefill, decode1, decode2 = pool[1]
            result = asyncio.run(one_run(model, plain, prefill, decode1, decode2, 100 + run,
                                         args.requests))  # fmt: skip
            bad += not result.ok()
            print(f"run {run + 1}: {result.line()}", flush=True)
            if args.fresh or run == args.runs - 1:
                for srv in [*pool[1], pool[0]]:
                    srv.stop()
                pool = None
    finally:
        if pool is not None:
            for srv in [*pool[1], pool[0]]:
                srv.stop()
        plain.stop()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
