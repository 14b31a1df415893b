"""Pool mode at its limits, end to end: a tiny pool (own mooncake_master, three 16 MiB segments)
with a prefill and a decode of the suite's Llama under vLLM's default ``kv_load_failure_policy``,
and an instance of another model on the same pool. Compared token for token with the suite's
plain server. (Its own module so that its servers never run beside ``test_pool_e2e``'s.)
"""

from __future__ import annotations

import random
from functools import partial

import pytest

from harness.pd import (
    ServerSpec,
    complete,
    eventually,
    greedy_body,
    minimal_proxy,
    pool_args,
    pool_counter,
    pool_extra,
    start_with_master,
)
from harness.servers import start_mooncake_master
from harness.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.servers

MAX_TOKENS = 8
EXTERNAL = "vllm:prompt_tokens_by_source_total"
# Three 16 MiB segments: 48 blocks of the suite's Llama (1 MiB a block).
SEGMENT_MIB, POOL_BLOCKS = 16, 48
# Not the suite's Llama (3 layers, 3 KV heads of 32): another layout in the same pool.
OTHER_MODEL = TinyModelSpec(layers=3, hidden=192, heads=6, kv_heads=3, head_dim=32,
                            intermediate=384, seed=4321)  # fmt: skip


@pytest.fixture(scope="module")
def small_pool(cluster):
    master = start_mooncake_master()
    extra = pool_extra(master, global_segment_size=f"{SEGMENT_MIB}MB")
    other = str(build_tiny_model(spec=OTHER_MODEL))
    specs = [
        ServerSpec("small-prefill", args=pool_args("kv_both", extra)),
        ServerSpec("small-decode", args=pool_args("kv_both", extra)),
        ServerSpec("small-other", args=pool_args("kv_both", extra), model=other),
    ]
    servers = start_with_master(cluster.model, master, specs)
    yield {
        "model": cluster.model, "plain": cluster.plain, "prefill": servers[0],
        "decode": servers[1], "other": servers[2], "other_model": other,
    }  # fmt: skip
    for srv in (*servers, master):
        srv.stop()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


body = partial(greedy_body, max_tokens=MAX_TOKENS, ignore_eos=True)


async def test_a_full_pool_fails_or_evicts_puts_and_every_request_still_answers_right(
    small_pool, http
):
    """Twice the pool's size in prompts behind the minimal proxy: token-exact answers, no
    failed request, and the pool keeps serving the newest prompts."""
    model, prefill, decode = small_pool["model"], small_pool["prefill"], small_pool["decode"]
    batch = prompts(seed=8, lengths=[1300, 1100, 1400, 1200] * 3)
    assert sum(len(p) for p in batch) // 128 > 2 * POOL_BLOCKS
    ext0 = decode.metric(EXTERNAL, source="external_kv_transfer")
    for i, prompt in enumerate(batch):
        ref = await complete(http, small_pool["plain"], body(model, prompt))
        got = await minimal_proxy(http, prefill, decode, body(model, prompt, stream=i % 2 == 0))
        assert got.token_ids == ref.token_ids, i
    await eventually(lambda: pool_counter(prefill, "put_blocks") > 0)
    put, refused = pool_counter(prefill, "put_blocks"), pool_counter(prefill, "put_failures")
    ext = decode.metric(EXTERNAL, source="external_kv_transfer") - ext0
    print(f"small pool: prefill put {put:.0f} blocks, {refused:.0f} refused; decode got "
          f"{ext:.0f} of {sum(map(len, batch))} prompt tokens from the pool")  # fmt: skip
    assert put + refused >= 2 * POOL_BLOCKS
    assert ext > 0
    assert pool_counter(decode, "load_failures") == 0


async def test_an_instance_of_another_model_never_reads_the_pools_kv(small_pool, http):
    """The same token ids prefilled by the Llama are asked of another model on the same pool:
    its lookups find nothing (keys are salted with the model and KV layout), nothing is read."""
    model, prefill, other = small_pool["model"], small_pool["prefill"], small_pool["other"]
    prompt = prompts(seed=9, lengths=[900])[0]
    await complete(http, prefill, body(model, prompt, max_tokens=1))
    lookups0 = pool_counter(other, "lookups")
    ext0 = other.metric(EXTERNAL, source="external_kv_transfer")
    first = await complete(http, other, body(small_pool["other_model"], prompt))
    assert len(first.token_ids) == MAX_TOKENS
    await eventually(lambda: pool_counter(other, "lookups") > lookups0)
    assert pool_counter(other, "hit_blocks") == 0
    assert pool_counter(other, "get_blocks") == 0
    assert other.metric(EXTERNAL, source="external_kv_transfer") == ext0
