"""``benchmarks.kv_routing``'s workload through the router's own code, without engines.

    python -m benchmarks.kv_routing_sim [--seeds 20] [--weights 2 2.5 4]

For choosing ``kv_index.SHARE_WEIGHT``: per seed, the conversations ``kv_routing`` plays (two
at a time, turn by turn, here interleaved one turn each), each prompt routed by a
``BackendPool`` under ``--policy kv`` per role (two prefills, two decodes), and the engine it
picks caches the prompt's full blocks (published to the index as vLLM would; no eviction). A
request then costs its tokens past the leading blocks its engine holds (at most
``(len - 1) // block`` reused). Reports, per weight, computed tokens over ``reuse_bound`` (mean,
p90, worst over seeds and roles) and the worst share of one engine. The real run is
``benchmarks.kv_routing``; this only ranks settings, in seconds.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence

from benchmarks.kv_routing import BLOCK_SIZE, reuse_bound
from benchmarks.prefix_routing import make_chats
from mooncake_vllm.proxy import kv_index, prefix
from mooncake_vllm.proxy.kv_index import KvIndex
from mooncake_vllm.proxy.routing import BackendPool, Policy


def interleave(chats: Sequence[Sequence[list[int]]], at_a_time: int = 2) -> list[list[int]]:
    """The prompts in the order ``at_a_time`` clients send them, one turn each in turn."""
    queue = list(chats)
    active = [iter(queue.pop(0)) for _ in range(min(at_a_time, len(queue)))]
    order: list[list[int]] = []
    while active:
        for it in list(active):
            prompt = next(it, None)
            if prompt is None:
                active.remove(it)
                if queue:
                    active.append(iter(queue.pop(0)))
                continue
            order.append(prompt)
    return order


def route(order: Sequence[list[int]], role: str) -> tuple[int, float]:
    """(tokens computed, largest share of one engine) routing ``order`` over two engines."""
    urls = (f"http://{role}0:1", f"http://{role}1:1")
    index = KvIndex()
    pool = BackendPool(role, urls, Policy.KV, cache=index)
    hashes = itertools.count(1)
    cost = 0
    picks = dict.fromkeys(urls, 0)
    for prompt in order:
        url = pool.pick(key=prefix.prefix_key({"prompt": prompt}), token_ids=prompt).url
        picks[url] += 1
        held = index.matched_tokens(prompt, [url])[url]
        cost += len(prompt) - min(held, (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE)
        n = len(prompt) // BLOCK_SIZE
        index.apply(url, {"type": "BlockStored", "block_hashes": [next(hashes) for _ in range(n)],
                          "parent_block_hash": None, "token_ids": prompt[: n * BLOCK_SIZE],
                          "block_size": BLOCK_SIZE})  # fmt: skip
    return cost, max(picks.values()) / len(order)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--weights", type=float, nargs="+", default=[2.0, 2.5, 3.0, 4.0])
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--chats", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args(argv)
    workloads = []
    for seed in range(args.seeds):
        chats = make_chats(7000 + seed, args.systems, args.chats, args.turns, 512, 200)
        order = interleave(chats)
        workloads.append((order, reuse_bound(order, BLOCK_SIZE)))
    default = kv_index.SHARE_WEIGHT
    try:
        for weight in args.weights:
            kv_index.SHARE_WEIGHT = weight
            ratios, shares = [], []
            for order, bound in workloads:
                for role in ("prefill", "decode"):
                    cost, share = route(order, role)
                    ratios.append(cost / bound)
                    shares.append(share)
            ratios.sort()
            print(f"weight {weight:g}: x bound mean {sum(ratios) / len(ratios):.3f} "
                  f"p90 {ratios[int(0.9 * len(ratios))]:.3f} worst {ratios[-1]:.3f}; "
                  f"worst share {100 * max(shares):.0f} %"
                  + (" (the default)" if weight == default else ""))  # fmt: skip
    finally:
        kv_index.SHARE_WEIGHT = default
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
