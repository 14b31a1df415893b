"""Hand check: MLA handovers between engines of different TP sizes, with real servers.

    python -m harness.mla_tp_check [--lengths 40 300 700 1200]

Starts the tiny MLA model three times: ``tp2`` (kv_both, ``--tensor-parallel-size 2``, mp
executor), ``tp1`` (kv_both) and a plain reference, then hands prompts over tp2 → tp1, tp1 → tp2
and tp2 → tp2, and prints for each direction: token equality with plain and with the consumer
computing the prompt itself, the consumer's pulls, bytes and failures,
prompt tokens by external transfer, and the producer's released/expired leases. The latent is
replicated across TP ranks, so every consumer rank should pull it exactly once: pulls = requests ×
consumer TP size, bytes = latent pages × consumer TP size. Not in the test suite: TP2 servers take
minutes to start on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from harness.pd import (
    ServerSpec,
    client_session,
    complete,
    kv_args,
    reference_spec,
    start_many,
    two_legs,
)
from harness.tiny_model import MLA_CPU_ARGS, TinyMLASpec, build_tiny_model

SPEC = TinyMLASpec()
BLOCK, MAX_TOKENS = 16, 8
TP2_HOST, TP1_HOST = "127.0.0.8", "127.0.0.9"


def kv_both(host: str, port: int) -> list[str]:
    extra = {"prefill_url": f"{host}:{port}", "decode_url": f"{host}:{port + 40}"}
    return kv_args("kv_both", extra, kv_load_failure_policy="recompute")


def snapshot(consumer, producer) -> dict[str, float]:
    return {
        "pulls": consumer.metric("mooncake_vllm:pulls_total"),
        "bytes": consumer.metric("mooncake_vllm:bytes_total"),
        "failures": consumer.metric("mooncake_vllm:pull_failures_total"),
        "external_tokens": consumer.metric(
            "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        ),
        "released": producer.metric("mooncake_vllm:released_total"),
        "expired": producer.metric("mooncake_vllm:expired_total"),
    }


async def direction(http, plain, producer, consumer, consumer_tp: int, lengths, seed: int):
    """``plain`` computes the references; the consumer itself too (a request without a handoff
    is computed locally), so a TP2 consumer is also compared with TP2 arithmetic."""
    rng = random.Random(seed)
    before = snapshot(consumer, producer)
    equal, equal_same_tp, pages, prompt_tokens = 0, 0, 0, 0
    for n in lengths:
        prompt = [rng.randrange(3, SPEC.vocab) for _ in range(n)]
        body = {"model": plain.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        ref = await complete(http, plain, body)
        local = await complete(http, consumer, body)
        _, tail = await two_legs(http, producer, consumer, body)
        equal += tail.token_ids == ref.token_ids
        equal_same_tp += tail.token_ids == local.token_ids
        pages += -(-n // BLOCK)
        prompt_tokens += n
    await asyncio.sleep(3)  # vLLM publishes connector stats after the step
    after = snapshot(consumer, producer)
    delta = {k: after[k] - before[k] for k in after}
    return {
        "requests": len(lengths),
        "token_equal_plain_tp1": equal,
        "token_equal_consumer_local": equal_same_tp,
        **delta,
        "expected_pulls": len(lengths) * consumer_tp,
        "expected_bytes": pages * BLOCK * SPEC.kv_bytes_per_token * consumer_tp,
        "prompt_tokens": prompt_tokens,
    }


async def run(servers, lengths):
    plain, tp2, tp1 = servers
    out = {}
    async with client_session(600) as http:
        for name, producer, consumer, consumer_tp, seed in (
            ("tp2->tp1", tp2, tp1, 1, 1),
            ("tp1->tp2", tp1, tp2, 2, 2),
            ("tp2->tp2", tp2, tp2, 2, 3),
        ):
            t0 = time.monotonic()
            out[name] = await direction(http, plain, producer, consumer, consumer_tp, lengths, seed)
            out[name]["seconds"] = round(time.monotonic() - t0, 1)
            print(name, out[name], flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[40, 300, 700, 1200])
    args = ap.parse_args(argv)
    model = str(build_tiny_model(spec=SPEC))
    specs = [
        reference_spec("plain-mla-tp", args=MLA_CPU_ARGS),
        ServerSpec(
            "mla-tp2",
            TP2_HOST,
            [
                *MLA_CPU_ARGS,
                "--tensor-parallel-size",
                "2",
                "--distributed-executor-backend",
                "mp",
                *kv_both(TP2_HOST, 13200),
            ],
        ),
        ServerSpec("mla-tp1", TP1_HOST, [*MLA_CPU_ARGS, *kv_both(TP1_HOST, 13300)]),
    ]
    t0 = time.monotonic()
    started = start_many(model, specs, timeout_s=1800)
    print(f"servers up after {time.monotonic() - t0:.0f} s", flush=True)
    try:
        asyncio.run(run(started, args.lengths))
    finally:
        for srv in reversed(started):
            srv.stop()
    print(f"total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
