"""A hybrid KV cache through the pool: the tiny random-weight Gemma 3 of ``test_hybrid_e2e``
(sliding-window layers between full-attention ones) served by a real mooncake_master, a
producer and a decode of ``MooncakeStoreConnector`` and a plain vLLM, every engine on one
address, vLLM's default ``fail`` policy, the minimal proxy's flow (the producer with
``max_tokens=1``, then the decode, nothing passed between).

The pool connector is ``SupportsHMA``: vLLM keeps its hybrid allocator on (three KV cache
groups). Each group's blocks have keys of their own (``pool.keys``); the producer puts every
block of every group as it computes it, and the decode gets every prompt block of the full
group and, of a sliding group, only the blocks from the window of the first token it computes
on (``core.kv_groups``). The byte counter is checked against exactly that, and against what the
same six layers all of full attention would move (the module prints both).
"""

from __future__ import annotations

import asyncio
from functools import partial

import pytest
from test_hybrid_e2e import (
    FULL_LAYERS,
    HMA_OFF,
    LAYER_PAGE,
    SLIDING_LAYERS,
    SPEC,
    blocks,
    prompts,
    sliding_blocks,
)

from harness.pd import (
    POOL_COUNTERS,
    complete,
    greedy_body,
    minimal_proxy,
    stop_servers,
    tokens_by_transfer,
)
from harness.pool_hosts import start_pool_trio
from harness.tiny_model import build_tiny_model

pytestmark = pytest.mark.servers

MAX_TOKENS = 8
# Prompts of two or more blocks (the window drops the early ones) and short ones.
LENGTHS = [100, 129, 255, 256, 257, 300, 511, 700, 1000, 1300, 1600, 129, 640, 900, 1200, 1500]
body = partial(greedy_body, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, request):
    model = str(build_tiny_model(spec=SPEC))
    master, engines = start_pool_trio(model, "pool-gemma3", tmp_path_factory.mktemp("pool-hybrid"))
    yield {**engines, "model": model}
    stop_servers([master, *engines.values()], print_logs=request.session.testsfailed > 0)


def test_both_pool_engines_keep_the_hybrid_allocator_and_three_groups(pool):
    per_group = SPEC.layers // 3 * LAYER_PAGE  # three groups of two layers
    line = f"6 segments, {per_group}/{per_group}/{per_group} B/block"
    for name in ("plain", "prefill", "decode"):
        log = pool[name].process.log_tail(500_000)
        assert HMA_OFF not in log, name
        if name != "plain":
            assert line in log, name


def get_bytes(n: int) -> int:
    """What the decode gets for a prompt of ``n`` tokens: it claims ``n - 1``, every block of
    that in the full group, a sliding group's from the window of token ``n - 1`` on."""
    return (blocks(n - 1) * FULL_LAYERS + sliding_blocks(n) * SLIDING_LAYERS) * LAYER_PAGE


async def test_prompts_come_from_the_pool_by_group_and_answer_as_plain(pool, http):
    prefill, decode = pool["prefill"], pool["decode"]
    batch = prompts(seed=960, lengths=LENGTHS)
    refs = [await complete(http, pool["plain"], body(pool["model"], p)) for p in batch]
    p0, d0 = POOL_COUNTERS.read(prefill), POOL_COUNTERS.read(decode)
    ext0 = tokens_by_transfer(decode)
    sem = asyncio.Semaphore(8)

    async def one(i, prompt):
        async with sem:
            request = body(pool["model"], prompt, stream=i % 2 == 1)
            return await minimal_proxy(http, prefill, decode, request)

    got = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    mismatches = [(len(p), r.token_ids, g.token_ids)
                  for p, r, g in zip(batch, refs, got, strict=True)
                  if g.token_ids != r.token_ids]  # fmt: skip
    assert not mismatches, f"decode differs from plain for (len, plain, decode): {mismatches}"

    put, moved = POOL_COUNTERS.since(prefill, p0), POOL_COUNTERS.since(decode, d0)
    assert (put["put_failures"], moved["load_failures"], moved["put_failures"]) == (0, 0, 0)
    assert moved["loads"] == len(batch)
    # Every group's every block put by the producer (its window's too: it computed them all).
    assert put["put_bytes"] == sum(blocks(len(p)) * SPEC.layers * LAYER_PAGE for p in batch)
    assert moved["get_bytes"] == sum(get_bytes(len(p)) for p in batch)
    expected = sum(len(p) for p in batch)
    ext = tokens_by_transfer(decode) - ext0
    assert ext == expected - len(batch), (ext, expected)  # all but each prompt's last token
    all_full = sum(blocks(len(p)) * SPEC.layers * LAYER_PAGE for p in batch)
    print(
        f"\npool hybrid gets: {moved['get_bytes']:.0f} B for {len(batch)} prompts "
        f"({expected} tokens); the same layers all of full attention: {all_full} B "
        f"({moved['get_bytes'] / all_full:.2f}x)"
    )
