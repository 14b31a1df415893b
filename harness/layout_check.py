"""By hand: per-head K/V between TP sizes with replicated KV heads, on real servers.

    python -m harness.layout_check --kv-heads 1 --tp 2
    python -m harness.layout_check --kv-heads 2 --tp 4
    python -m harness.layout_check --tp 1 --block-sizes 32 128

Starts the tiny Llama with ``--kv-heads`` KV heads three times: a plain TP1 server, a kv_both
engine at ``--tp`` (mp executor) and a kv_both TP1 engine, both without prefix caching. Hands five
prompts (1–700 tokens) each way and prints, per direction: answers differing from plain's, pulls,
pull failures, bytes pulled against the model's KV of the prompt's blocks, prompt tokens by
transfer, how long the producer still held leases after the last answer, and leases that expired
(a producer rank nobody reads must be given back, not left to its TTL). With fewer KV heads than
TP ranks each decode rank reads its replica, so a decode at the larger TP pulls the KV once per
rank that holds the same head. ``--block-sizes A B`` serves the ``--tp`` engine with A-token blocks
and the TP1 one with B (vLLM's CPU attention takes multiples of 32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

from harness.pd import (
    PULL_COUNTERS,
    ServerSpec,
    client_session,
    complete,
    kv_args,
    mooncake_json,
    pulls_since,
    reference_spec,
    start_many,
    tokens_by_transfer,
    two_legs,
)
from harness.tiny_model import TinyModelSpec, build_tiny_model

LENGTHS = (1, 31, 127, 129, 300, 700)


def _engine(host: str, port: int, *extra: str) -> list[str]:
    config = {"prefill_url": f"{host}:{port}"}
    return [*extra, "--no-enable-prefix-caching", *kv_args("kv_both", config)]


async def _leg(name, spec, model, plain, producer, consumer, consumer_tp, block) -> dict:
    """``block``: the producer's block size (whole producer blocks are read)."""
    rng = random.Random(name)
    prompts = [[rng.randrange(3, spec.vocab) for _ in range(n)] for n in LENGTHS]
    before, by_transfer = PULL_COUNTERS.read(consumer), tokens_by_transfer(consumer)
    expired = producer.metric("mooncake_vllm:expired_total")
    differ = 0
    async with client_session() as http:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            ref = await complete(http, plain, body)
            _, tail = await two_legs(http, producer, consumer, body)
            differ += tail.token_ids != ref.token_ids
    moved = await pulls_since(consumer, before, len(prompts) * consumer_tp)
    t0 = time.monotonic()
    while producer.metric("mooncake_vllm:held_leases") and time.monotonic() - t0 < 60:
        await asyncio.sleep(0.1)
    kv_per_token = spec.layers * spec.kv_heads * 2 * spec.head_dim * 4
    return {
        "direction": name,
        "prompts": len(prompts),
        "differ_from_plain": differ,
        "pulls": moved["pulls"],
        "pull_failures": moved["pull_failures"],
        "bytes": moved["bytes"],
        "model_kv_bytes_of_the_blocks": sum(-(-len(p) // block) for p in prompts)
        * block
        * kv_per_token,
        "tokens_by_transfer": tokens_by_transfer(consumer) - by_transfer,
        "prompt_tokens": sum(map(len, prompts)),
        "producer_held_after_s": round(time.monotonic() - t0, 2),
        "producer_leases_expired": producer.metric("mooncake_vllm:expired_total") - expired,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--block-sizes", type=int, nargs=2, default=(128, 128), metavar=("A", "B"))
    args = ap.parse_args(argv)
    block_x, block_1 = args.block_sizes
    spec = TinyModelSpec(kv_heads=args.kv_heads)
    model = str(build_tiny_model(spec=spec))
    cfg = mooncake_json(Path(tempfile.mkdtemp()) / "mooncake.json")
    env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
    big = ["--tensor-parallel-size", str(args.tp), "--distributed-executor-backend", "mp"]
    specs = [
        reference_spec("plain"),
        ServerSpec(
            f"tp{args.tp}-b{block_x}",
            "127.0.0.11",
            _engine("127.0.0.11", 13060, *big, "--block-size", str(block_x)),
            env,
        ),
        ServerSpec(
            f"tp1-b{block_1}",
            "127.0.0.12",
            _engine("127.0.0.12", 13080, "--block-size", str(block_1)),
            env,
        ),
    ]
    t0 = time.monotonic()
    plain, wide, narrow = start_many(model, specs, timeout_s=1800)
    print(f"servers up after {time.monotonic() - t0:.0f} s", flush=True)

    async def run() -> None:
        for name, producer, consumer, tp, block in (
            (f"TP1/{block_1} -> TP{args.tp}/{block_x}", narrow, wide, args.tp, block_1),
            (f"TP{args.tp}/{block_x} -> TP1/{block_1}", wide, narrow, 1, block_x),
        ):
            leg = await _leg(name, spec, model, plain, producer, consumer, tp, block)
            print(json.dumps(leg))

    try:
        asyncio.run(run())
    finally:
        for server in (narrow, wide, plain):
            server.stop()
    print(f"total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
