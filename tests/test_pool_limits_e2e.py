"""Pool mode at its limits, end to end: a tiny pool (own mooncake_master, three 16 MiB segments)
with a prefill and a decode of the suite's Llama under vLLM's default ``kv_load_failure_policy``,
and an instance of another model on the same pool. Compared token for token with the suite's
plain server. (Its own module so that its servers never run beside ``test_pool_e2e``'s.)

Every counter is read as a difference around the test's own requests.
"""

from __future__ import annotations

import asyncio
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
from harness.servers import metric_totals, start_mooncake_master
from harness.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.servers, pytest.mark.long]  # own engines, ~100 s: make test-long

MAX_TOKENS = 8
BLOCK = 128  # vLLM's CPU block size: one pool key per block and TP rank
# Three 16 MiB segments: 48 blocks of the suite's Llama (4 layers x K,V x 4 heads x 64 x 128
# tokens x 4 B = 1 MiB a block).
SEGMENT_MIB, POOL_BLOCKS = 16, 48
# mooncake_master's default --eviction_high_watermark_ratio: above it the master evicts.
EVICTION_WATERMARK = 0.9
# mooncake_master's default --default_kv_lease_ttl: a read leases its objects this long, and
# the master evicts no leased object.
READ_LEASE_S = 10.0
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
        "decode": servers[1], "other": servers[2], "other_model": other, "master": master,
    }  # fmt: skip
    for srv in (*servers, master):
        srv.stop()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


def blocks(n: int) -> int:
    """Pool keys of an ``n``-token prompt: its full blocks and the partial tail."""
    return -(-n // BLOCK)


body = partial(greedy_body, max_tokens=MAX_TOKENS, ignore_eos=True)


def master_figures(master) -> dict[str, float]:
    return metric_totals(f"http://{master.host}:{master.metrics_port}/metrics")


async def test_a_full_pool_fails_or_evicts_puts_and_every_request_still_answers_right(
    small_pool, http
):
    """Twice the pool's size in prompts behind the minimal proxy, one at a time: token-exact
    answers and no failed load. Each decode claims exactly the leading blocks its one lookup
    found (all of them while the pool has room), every block is put, skipped or refused once,
    and the pool, full, evicts and keeps serving the later prompts."""
    model, prefill, decode = small_pool["model"], small_pool["prefill"], small_pool["decode"]
    master = small_pool["master"]
    lengths = [1300, 1100, 1400, 1200] * 3
    batch = prompts(seed=8, lengths=lengths)
    n_blocks = [blocks(n) for n in lengths]
    assert sum(n_blocks) > 2 * POOL_BLOCKS
    # The first round (41 blocks) fits under the eviction watermark of an empty pool.
    first_round = len(lengths) // 3
    assert sum(n_blocks[:first_round]) <= EVICTION_WATERMARK * POOL_BLOCKS
    assert master_figures(master)["master_key_count"] == 0, "this test starts on an empty pool"
    evicted0 = master_figures(master)["master_evicted_key_count_total"]
    prefill0, decode0 = POOL_COUNTERS.read(prefill), POOL_COUNTERS.read(decode)
    hits: list[int] = []
    claimed: list[int] = []  # prompt tokens each decode counted as external
    for i, prompt in enumerate(batch):
        if i == first_round:
            # The first round's blocks stay leased for a while after the decode read them, and
            # the master evicts none of them meanwhile: a fresh prompt's blocks, put into the
            # full pool, would be the only ones it could evict (seen on a fast host: no later
            # prompt found its blocks). Let those leases end first.
            await asyncio.sleep(READ_LEASE_S + 0.5)
        ref = await complete(http, small_pool["plain"], body(model, prompt))
        before, ext0 = POOL_COUNTERS.read(decode), tokens_by_transfer(decode)
        got = await minimal_proxy(http, prefill, decode, body(model, prompt, stream=i % 2 == 0))
        assert got.token_ids == ref.token_ids, i
        # The decode (kv_both) looked the prompt up once and claimed the leading blocks found:
        # vLLM counts those tokens, the trailing partial block included, as external.
        await settles_at(
            lambda b=before: POOL_COUNTERS.since(decode, b)["lookups"], 1, f"prompt {i}: lookups"
        )
        found = POOL_COUNTERS.since(decode, before)
        hit = int(found["hit_blocks"])
        assert hit + found["miss_blocks"] == n_blocks[i], (i, found)
        want = min(len(prompt), BLOCK * hit)
        await settles_at(
            lambda e=ext0: tokens_by_transfer(decode) - e, want, f"prompt {i}: {hit} blocks"
        )
        hits.append(hit)
        claimed.append(want)
    evicted = master_figures(master)["master_evicted_key_count_total"] - evicted0
    print(f"small pool: decode found {hits} of {n_blocks} blocks; {sum(hits)} of "
          f"{sum(n_blocks)} ({sum(claimed)} of {sum(lengths)} prompt tokens); the master "
          f"evicted {evicted:.0f} keys")  # fmt: skip
    assert hits[:first_round] == n_blocks[:first_round]  # room: every prompt whole
    assert sum(hits[first_round:]) > 0  # full: eviction makes room for later prompts
    assert evicted > 0

    # The prefill (kv_both) found none of its fresh prompts and saved every block once: put,
    # or refused by the full pool; none was there already.
    p = await _puts_settle(prefill, prefill0, sum(n_blocks))
    assert (p["lookups"], p["hit_blocks"], p["miss_blocks"]) == (len(batch), 0, sum(n_blocks))
    assert (p["put_skipped_blocks"], p["get_blocks"], p["load_failures"]) == (0, 0, 0)
    assert p["put_blocks"] >= sum(n_blocks[:first_round])
    # The decode read what it claimed, without a failure, and saved the blocks it computed.
    d = await _puts_settle(decode, decode0, sum(n_blocks) - sum(hits))
    assert (d["lookups"], d["hit_blocks"]) == (len(batch), sum(hits))
    assert (d["get_blocks"], d["loads"]) == (sum(hits), sum(1 for h in hits if h))
    assert d["load_failures"] == 0
    print(f"prefill put {p['put_blocks']:.0f}, refused {p['put_failures']:.0f}; decode put "
          f"{d['put_blocks']:.0f}, skipped {d['put_skipped_blocks']:.0f}, refused "
          f"{d['put_failures']:.0f}")  # fmt: skip


async def _puts_settle(srv, before: dict[str, float], saved: int) -> dict[str, float]:
    """``srv``'s counters since ``before``, once its ``saved`` blocks are all accounted for."""

    def accounted() -> float:
        d = POOL_COUNTERS.since(srv, before)
        return d["put_blocks"] + d["put_skipped_blocks"] + d["put_failures"]

    await settles_at(accounted, saved, f"{srv.process.name}: blocks put, skipped or refused")
    return POOL_COUNTERS.since(srv, before)


async def test_an_instance_of_another_model_never_reads_the_pools_kv(small_pool, http):
    """Token ids the Llama's decode has just found in the pool (and holds a lease on: the master
    keeps them 10 s) are asked of another model on the same pool: its lookup finds nothing
    (keys are salted with the model and KV layout), nothing is read, and its own puts find no
    key of the Llama's there."""
    model, prefill, decode = small_pool["model"], small_pool["prefill"], small_pool["decode"]
    other = small_pool["other"]
    # The previous test leaves the pool full, much of it under the master's 10 s read leases: a
    # put is refused ("no space") until they end and the master evicts, and a key put may be
    # evicted again before the decode looks. Wait for the prefill's puts (they land after its
    # answer) and take a fresh prompt, 2 s later, until the decode finds the Llama's KV. A full
    # pool may settle into refusing one block of every prompt (what the master evicts is refilled
    # by the next put: 10 tries in a row put 7 of 8 once, 2026-11-26): some blocks are enough.
    found = {}
    for seed in range(9, 19):
        if seed > 9:
            await asyncio.sleep(2.0)
        prompt = prompts(seed=seed, lengths=[900])[0]
        p0 = POOL_COUNTERS.read(prefill)
        await complete(http, prefill, body(model, prompt, max_tokens=1))
        p = await _puts_settle(prefill, p0, blocks(len(prompt)))
        if p["put_blocks"] == 0:
            continue  # all refused by the full pool
        before = POOL_COUNTERS.read(decode)
        await complete(http, decode, body(model, prompt))
        await settles_at(
            lambda b=before: POOL_COUNTERS.since(decode, b)["lookups"], 1, "the Llama's lookup"
        )
        found = POOL_COUNTERS.since(decode, before)
        if found["hit_blocks"] >= 1:
            break
    assert found.get("hit_blocks", 0) >= 1, "the Llama's KV is not in the pool"

    before, ext0 = POOL_COUNTERS.read(other), tokens_by_transfer(other)
    first = await complete(http, other, body(small_pool["other_model"], prompt))
    assert len(first.token_ids) == MAX_TOKENS
    await settles_at(
        lambda: POOL_COUNTERS.since(other, before)["lookups"], 1, "the other model's lookup"
    )
    o = await _puts_settle(other, before, blocks(len(prompt)))
    assert (o["hit_blocks"], o["miss_blocks"]) == (0, blocks(len(prompt)))
    assert (o["loads"], o["get_blocks"], o["put_skipped_blocks"]) == (0, 0, 0)
    assert tokens_by_transfer(other) == ext0
