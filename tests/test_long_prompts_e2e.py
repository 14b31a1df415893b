"""Long prompts through the pair: 4k, 8k and 15k tokens, one at a time and eight at once.

The shared cluster runs at ``--max-model-len`` 16 384 (``tests/conftest.py``). Its prefill runs
with ``--max-num-batched-tokens 2048`` (vLLM's CPU default for the OpenAI server, spelled out):
vLLM's scheduler gives a step at most that many tokens, so it computes a 15k-token prompt in
eight chunked steps or more, and the lease it grants must cover every one of them. Our proxy
sends each request to the prefill and then to the cluster's ``kv_both`` engine as the decode,
which fails a request whose pull fails (vLLM's default ``kv_load_failure_policy``): each answer
equals the plain vLLM's, and the decode loads ≥ 99 % of the prompt tokens by transfer, in one
pull.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from conftest import PREFILL_BATCHED_TOKENS

from harness.pd import PULL_COUNTERS, complete, greedy_body, pulls_since, tokens_by_transfer

pytestmark = pytest.mark.servers

MAX_TOKENS = 8


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


async def _through_the_pair(pd, start_proxy, http, prompts, concurrency: int):
    proxy = await start_proxy(prefill=[pd.prefill.url], decode=[pd.both.url])
    sem = asyncio.Semaphore(concurrency)

    async def one(i, prompt):
        async with sem:
            body = greedy_body(pd.model, prompt, MAX_TOKENS, stream=i % 2 == 1)
            return (await complete(http, proxy, body)).token_ids

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def _references(pd, http, prompts) -> list[list[int]]:
    return [
        (await complete(http, pd.plain, greedy_body(pd.model, p, MAX_TOKENS))).token_ids
        for p in prompts
    ]


@pytest.mark.parametrize("length", [4096, 8192, 15_000])
async def test_a_long_prompt_arrives_whole_by_transfer(pd, start_proxy, http, length):
    prompt = _prompt(length, length)
    ext0 = tokens_by_transfer(pd.both)
    pulls0 = PULL_COUNTERS.read(pd.both)
    [answer] = await _through_the_pair(pd, start_proxy, http, [prompt], concurrency=1)
    pulled = await pulls_since(pd.both, pulls0, 1)
    by_transfer = tokens_by_transfer(pd.both) - ext0
    [reference] = await _references(pd, http, [prompt])
    steps = math.ceil(length / PREFILL_BATCHED_TOKENS)
    print(f"{length} tokens: ≥ {steps} prefill steps, {by_transfer:.0f} by transfer, {pulled}")
    assert answer == reference
    # The lease covered every chunk: all but the last token came by transfer, in one pull.
    assert by_transfer >= 0.99 * length, by_transfer
    assert pulled["pulls"] == 1 and pulled["pull_failures"] == 0, pulled


async def test_eight_long_prompts_at_once(pd, start_proxy, http):
    rng = random.Random(8)
    prompts = [_prompt(100 + i, rng.randrange(4000, 8200)) for i in range(8)]
    ext0 = tokens_by_transfer(pd.both)
    pulls0 = PULL_COUNTERS.read(pd.both)
    answers = await _through_the_pair(pd, start_proxy, http, prompts, concurrency=8)
    pulled = await pulls_since(pd.both, pulls0, 8)
    by_transfer = tokens_by_transfer(pd.both) - ext0
    references = await _references(pd, http, prompts)
    total = sum(map(len, prompts))
    print(f"8 prompts, {total} tokens: {by_transfer:.0f} by transfer, {pulled}")
    assert answers == references
    assert by_transfer >= 0.99 * total, (by_transfer, total)
    assert pulled["pulls"] == 8 and pulled["pull_failures"] == 0, pulled
    assert pd.prefill.metric("mooncake_vllm:held_leases") == 0
