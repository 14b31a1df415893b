"""Pool mode with an MLA model: the tiny DeepSeek-V2-style model (one 576-wide latent per token
and layer, 16-token blocks on CPU) through ``MooncakeStoreConnector`` and a real
``mooncake_master``, behind the guide's minimal proxy, compared token for token with a plain vLLM.

An MLA engine stores its latent once (under rank 0's key, ``pool/keys.py``): a block's value is
that block's latent page of every layer, nothing per head, and the byte counters below say so.
"""

from __future__ import annotations

import random
from functools import partial

import pytest

from harness.pd import (
    POOL_COUNTERS,
    ServerSpec,
    complete,
    greedy_body,
    minimal_proxy,
    pool_args,
    pool_extra,
    settles_at,
    start_with_master,
    tokens_by_transfer,
)
from harness.servers import start_mooncake_master
from harness.tiny_model import MLA_CPU_ARGS, TinyMLASpec, build_tiny_model

pytestmark = pytest.mark.servers

SPEC = TinyMLASpec()
BLOCK = 16  # vLLM's block size for MLA on CPU
PAGE_BYTES = BLOCK * SPEC.kv_bytes_per_token  # one block: a latent page per layer
MAX_TOKENS = 8
LENGTHS = [1, 15, 16, 17, 100, 300, 513, 700, 1000, 1025, 1400, 1500]


@pytest.fixture(scope="module")
def mla_pool():
    model = str(build_tiny_model(spec=SPEC))
    master = start_mooncake_master()
    extra = pool_extra(master, global_segment_size="128MB")
    specs = [
        ServerSpec("plain-mla-pool", args=[*MLA_CPU_ARGS, "--distributed-executor-backend", "uni"]),
        ServerSpec("pool-mla-prefill", args=[*MLA_CPU_ARGS, *pool_args("kv_both", extra)]),
        ServerSpec("pool-mla-decode", args=[*MLA_CPU_ARGS, *pool_args("kv_both", extra)]),
    ]
    servers = start_with_master(model, master, specs)
    yield model, *servers
    for srv in [*reversed(servers), master]:
        srv.stop()


body = partial(greedy_body, max_tokens=MAX_TOKENS, ignore_eos=True)


async def test_mla_through_the_pool_equals_plain_one_latent_copy_per_block(mla_pool, http):
    model, plain, prefill, decode = mla_pool
    rng = random.Random(21)
    batch = [[rng.randrange(3, SPEC.vocab) for _ in range(n)] for n in LENGTHS]
    prefill0, decode0 = POOL_COUNTERS.read(prefill), POOL_COUNTERS.read(decode)
    ext0 = tokens_by_transfer(decode)
    mismatches = []
    for i, prompt in enumerate(batch):
        ref = await complete(http, plain, body(model, prompt))
        got = await minimal_proxy(http, prefill, decode, body(model, prompt, stream=i % 2 == 1))
        if got.token_ids != ref.token_ids:
            mismatches.append((len(prompt), ref.token_ids, got.token_ids))
    assert not mismatches, f"decode differs from plain for (len, plain, decode): {mismatches}"

    total = sum(len(p) for p in batch)
    ext = tokens_by_transfer(decode) - ext0
    print(f"MLA decode: {ext:.0f} of {total} prompt tokens from the pool")
    assert ext >= 0.95 * total
    # Every block of every prompt (the partial tails too) was put once, as one latent page per
    # layer; the decode got whole pages of the same size.
    blocks = sum(-(-len(p) // BLOCK) for p in batch)
    await settles_at(
        lambda: POOL_COUNTERS.since(prefill, prefill0)["put_blocks"], blocks, "blocks put"
    )
    p, d = POOL_COUNTERS.since(prefill, prefill0), POOL_COUNTERS.since(decode, decode0)
    assert p["put_bytes"] == blocks * PAGE_BYTES
    assert d["get_blocks"] > 0 and d["get_bytes"] == d["get_blocks"] * PAGE_BYTES
    assert (p["load_failures"], p["put_failures"]) == (0, 0)
    assert (d["load_failures"], d["put_failures"]) == (0, 0)
