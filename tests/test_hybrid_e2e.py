"""A hybrid KV cache through the pair: a tiny random-weight Gemma 3 (sliding-window layers
between full-attention ones, ``harness.tiny_model.TinyGemma3Spec``) served by a real prefill
and decode under vLLM's default ``fail`` policy, with vLLM's hybrid memory allocator on (our
connector is ``SupportsHMA``), compared token for token with a plain vLLM of the same model.

vLLM keeps such a model in KV cache groups of equal size: here two of sliding-window layers
and one of the full-attention layers. The decode pulls each group's blocks into the segments
of that group's layers: every prompt block of the full group, and of a sliding group only the
blocks from the window of the prompt's last token on (``core.kv_groups``). The byte counter is
checked against exactly that, and against what the same six layers all of full attention would
have moved (the module prints both).
"""

from __future__ import annotations

import asyncio
import random

import pytest
from test_connector_e2e import body, eventually, nothing_held, prefill_body

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
from harness.tiny_model import TinyGemma3Spec, build_tiny_model

pytestmark = pytest.mark.servers

SPEC = TinyGemma3Spec()
BLOCK = 128  # vLLM's default block size on CPU
HOST = "127.0.0.1"  # both engines on one address, as users also run them
MAX_TOKENS = 8
# Short prompts (inside one window), and long ones whose early blocks a sliding window drops.
LENGTHS = [1, 5, 100, 127, 128, 129, 200, 255, 256, 257, 300, 511, 700, 1000, 1300, 1600]
HMA_OFF = "Turning off hybrid kv cache manager"


def prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SPEC.vocab) for _ in range(n)] for n in lengths]


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def sliding_blocks(n: int) -> int:
    """The blocks of a sliding group the decode pulls for a prompt of ``n`` tokens: it loads
    ``n - 1`` (``kv_groups.claim_hold_back``), and vLLM allocates from the window of the
    token it then computes on."""
    return blocks(n - 1) - max(0, n - SPEC.sliding_window) // BLOCK


LAYER_PAGE = BLOCK * 2 * SPEC.kv_heads * SPEC.head_dim * 4  # one layer's K and V, float32
FULL_LAYERS = SPEC.layer_types.count("full_attention")
SLIDING_LAYERS = SPEC.layers - FULL_LAYERS


def pulled_bytes(n: int) -> int:
    return (blocks(n - 1) * FULL_LAYERS + sliding_blocks(n) * SLIDING_LAYERS) * LAYER_PAGE


class Pair:
    def __init__(self, model, plain, prefill, decode):
        self.model, self.plain, self.prefill, self.decode = model, plain, prefill, decode


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, request):
    model = str(build_tiny_model(spec=SPEC))
    cfg = mooncake_json(
        tmp_path_factory.mktemp("hybrid") / "mooncake.json",
        prefill_url=f"{HOST}:13300",
        decode_url=f"{HOST}:13310",
    )
    env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
    specs = [
        reference_spec("plain-gemma3"),
        ServerSpec("prefill-gemma3", HOST, kv_args("kv_producer"), env),
        ServerSpec("decode-gemma3", HOST, kv_args("kv_consumer"), env),
    ]
    started = start_many(model, specs)
    yield Pair(model, *started)
    stop_servers(started, print_logs=request.session.testsfailed > 0)


def test_both_engines_keep_the_hybrid_allocator_and_three_groups(hybrid):
    for srv in (hybrid.plain, hybrid.prefill, hybrid.decode):
        assert HMA_OFF not in srv.process.log_tail(500_000), srv.process.name
    window = f"sliding window {SPEC.sliding_window}"
    line = f"6 segments, {SPEC.layers * LAYER_PAGE} B/block, 3 KV cache group(s) ({window}, "
    line += f"{window}, full attention)"
    for srv in (hybrid.prefill, hybrid.decode):
        assert line in srv.process.log_tail(500_000), srv.process.name


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_outputs_equal_plain_and_each_group_moves_its_own_blocks(hybrid, http, stream):
    batch = prompts(seed=900 + stream)
    d = hybrid.decode
    ext0, before = tokens_by_transfer(d), PULL_COUNTERS.read(d)
    refs = [await complete(http, hybrid.plain, body(hybrid.model, p, max_tokens=MAX_TOKENS))
            for p in batch]  # fmt: skip
    sem = asyncio.Semaphore(8)

    async def one(prompt):
        async with sem:
            return await two_legs(
                http,
                hybrid.prefill,
                hybrid.decode,
                body(hybrid.model, prompt, stream=stream, max_tokens=MAX_TOKENS),
            )

    legs = await asyncio.gather(*(one(p) for p in batch))
    mismatches = []
    for prompt, ref, (head, tail) in zip(batch, refs, legs, strict=True):
        params = head.kv_transfer_params
        assert len(params["remote_block_ids"]) == blocks(len(prompt))
        assert [len(g) for g in params["group_block_ids"]] == [blocks(len(prompt))] * 2
        if tail.token_ids != ref.token_ids:
            mismatches.append((len(prompt), ref.token_ids, tail.token_ids))
    assert not mismatches, f"decode differs from plain for (len, plain, decode): {mismatches}"

    pulled = [p for p in batch if len(p) > 1]  # a 1-token prompt loads nothing
    moved = await pulls_since(d, before, len(pulled))
    assert (moved["pulls"], moved["pull_failures"]) == (len(pulled), 0)
    expected = sum(len(p) for p in batch)
    ext = tokens_by_transfer(d) - ext0
    assert ext >= 0.99 * expected - len(batch), (ext, expected)
    assert moved["bytes"] == sum(pulled_bytes(len(p)) for p in batch)
    all_full = sum(blocks(len(p)) * SPEC.layers * LAYER_PAGE for p in batch)
    print(
        f"\nhybrid pulls: {moved['bytes']:.0f} B for {len(batch)} prompts ({expected} tokens); "
        f"the same layers all of full attention: {all_full} B "
        f"({moved['bytes'] / all_full:.2f}x)"
    )
    await eventually(lambda: nothing_held(hybrid.prefill))


async def test_a_handoff_of_another_group_count_is_refused_naming_both(hybrid, http):
    """A producer that ran with the hybrid allocator off (one group) hands over to this
    decode: refused before a byte moves, the message naming both counts; vLLM's ``fail``
    policy answers an error."""
    prompt = prompts(seed=950, lengths=[400])[0]
    head = await complete(http, hybrid.prefill, prefill_body(hybrid.model, prompt))
    params = dict(head.kv_transfer_params, group_block_ids=[])
    before = PULL_COUNTERS.read(hybrid.decode)
    async with http.post(
        f"{hybrid.decode.url}/v1/completions",
        json=body(hybrid.model, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params),
    ) as resp:
        assert resp.status >= 400, await resp.text()
    moved = await pulls_since(hybrid.decode, before, 1)
    assert (moved["pull_failures"], moved["bytes"]) == (1, 0)
    log = hybrid.decode.process.log_tail(200_000)
    assert "1 KV cache groups at the producer, 3 here" in log
    await eventually(lambda: nothing_held(hybrid.prefill))
