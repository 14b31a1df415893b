"""EAGLE speculative decoding through the pair: a tiny random-weight EAGLE-1 draft head
(``harness.tiny_model.build_tiny_eagle``) on the tiny Llama, served by a plain vLLM, a prefill
and a decode with the same ``--speculative-config``, every engine on one address, vLLM's
default ``fail`` policy, compared token for token.

The draft head's attention layer has a KV cache of its own, beside the target's four: the
prefill computes the prompt's draft KV too, and the decode pulls it with the target's, by layer
name (each grant names its layers), so its first draft tokens read a complete draft cache. A
prefill without the draft (here the shared cluster's ``both`` instance) has no such layer: the
decode refuses that handoff at the first pull, naming the layer and the fix.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from harness.pd import (
    PULL_COUNTERS,
    ServerSpec,
    complete,
    eventually,
    greedy_body,
    kv_args,
    pulls_since,
    reference_spec,
    start_many,
    stop_servers,
    tokens_by_transfer,
    two_legs,
)
from harness.tiny_model import build_tiny_eagle
from tests.test_concurrent_e2e import nothing_held
from tests.test_features_e2e import LAYER_BLOCK, SPEC, blocks

pytestmark = pytest.mark.servers

HOST = "127.0.0.8"
MAX_TOKENS = 12
DRAFTS = "vllm:spec_decode_num_draft_tokens_total"


@pytest.fixture(scope="module")
def eagle(cluster, request):
    draft = build_tiny_eagle(cluster.model)
    spec = ["--speculative-config", json.dumps(
        {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2})]  # fmt: skip
    env = {"MOONCAKE_CONFIG_PATH": str(cluster.config_path)}
    prefill = kv_args("kv_producer", {"prefill_url": f"{HOST}:13220"})
    decode = kv_args("kv_consumer", {"decode_url": f"{HOST}:13230"})
    specs = [
        reference_spec("plain-eagle", HOST, spec),
        ServerSpec("prefill-eagle", HOST, [*prefill, *spec], env),
        ServerSpec("decode-eagle", HOST, [*decode, *spec], env),
    ]
    started = start_many(cluster.model, specs)
    yield dict(zip(("plain", "prefill", "decode"), started, strict=True))
    stop_servers(started, print_logs=request.session.testsfailed > 0)


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


async def test_the_drafts_kv_moves_with_the_targets_and_answers_are_plains(pd, http, eagle):
    plain, prefill, decode = eagle["plain"], eagle["prefill"], eagle["decode"]
    batch = prompts(81, [2, 60, 127, 128, 129, 300, 700, 1100, 5, 200, 257, 511, 900, 1300])
    refs = [await complete(http, plain, greedy_body(pd.model, p, MAX_TOKENS)) for p in batch]
    before, ext0 = PULL_COUNTERS.read(decode), tokens_by_transfer(decode)
    drafts0 = decode.metric(DRAFTS)
    sem = asyncio.Semaphore(8)

    async def one(i, prompt):
        async with sem:
            body = greedy_body(pd.model, prompt, MAX_TOKENS, stream=i % 2 == 1)
            return await two_legs(http, prefill, decode, body)

    legs = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    mismatches = [(len(p), r.token_ids, tail.token_ids)
                  for p, r, (_, tail) in zip(batch, refs, legs, strict=True)
                  if tail.token_ids != r.token_ids]  # fmt: skip
    assert not mismatches, f"decode differs from plain for (len, plain, decode): {mismatches}"
    moved = await pulls_since(decode, before, len(batch))
    assert (moved["pulls"], moved["pull_failures"]) == (len(batch), 0)
    # The target's four layers and the draft's one, every block.
    layers = SPEC.layers + 1
    assert moved["bytes"] == sum(blocks(len(p)) for p in batch) * layers * LAYER_BLOCK * 4
    total = sum(len(p) for p in batch)
    assert tokens_by_transfer(decode) - ext0 >= 0.99 * total - len(batch)
    assert decode.metric(DRAFTS) > drafts0  # the decode speculated
    await eventually(lambda: nothing_held(prefill) and nothing_held(decode), 15, "freed")


@pytest.mark.provokes_pull_failure
async def test_a_prefill_without_the_draft_is_refused_naming_its_layer(pd, http, eagle):
    decode = eagle["decode"]
    prompt = prompts(82, [300])[0]
    before = PULL_COUNTERS.read(decode)
    head = await complete(http, pd.both, greedy_body(pd.model, prompt, 1,
                          kv_transfer_params={"do_remote_decode": True}))  # fmt: skip
    body = greedy_body(pd.model, prompt, MAX_TOKENS, kv_transfer_params=head.kv_transfer_params)
    async with http.post(f"{decode.url}/v1/completions", json=body) as resp:
        assert resp.status >= 400, await resp.text()  # vLLM's fail policy
    moved = await pulls_since(decode, before, 1)
    assert (moved["pull_failures"], moved["bytes"]) == (1, 0)
    log = decode.process.log_tail(200_000)
    assert "holds no KV of layer(s) model.layers.4.self_attn.attn" in log
    assert "--speculative-config" in log
    await eventually(lambda: nothing_held(pd.both) and nothing_held(decode), 15, "freed")
