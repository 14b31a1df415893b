"""The pool's scheduler half in-process, with a dict for a store and stub requests and scheduler
outputs shaped like vLLM's: what it claims from the pool, which blocks it loads into, and which
blocks each step saves (no vLLM engine, no servers)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from mooncake_vllm.core.kv_groups import KVGroup
from mooncake_vllm.core.prompt_identity import MMSpan, PromptIdentity
from mooncake_vllm.core.settings import load_settings
from mooncake_vllm.pool.config import PoolSettings
from mooncake_vllm.pool.keys import block_keys, chain_digests
from mooncake_vllm.pool.scheduler import PoolSchedulerHalf

BLOCK = 128
SALT = "c" * 64
PROMPT = list(range(100, 400))  # 300 tokens: blocks 0, 1 full, block 2 partial (44 tokens)
DIGESTS = chain_digests(PROMPT, BLOCK, SALT)


class DictStore:
    """Answers existence checks like ``PoolStore.exists`` from a set of keys."""

    def __init__(self, keys=(), delay: threading.Event | None = None):
        self.keys, self.delay, self.asked = set(keys), delay, []

    def exists(self, keys):
        self.asked.append(list(keys))
        if self.delay is not None:
            self.delay.wait(5)
        return [1 if k in self.keys else 0 for k in keys]

    def close(self):
        pass


def half(
    store, *, producer=True, consumer=True, tp_size=1, replicated=False, **settings
) -> PoolSchedulerHalf:
    s = load_settings(
        {"master_server_address": "127.0.0.1:1", "metadata_server": "P2PHANDSHAKE", **settings},
        env={},
        model=PoolSettings,
    )
    return PoolSchedulerHalf(s, is_producer=producer, is_consumer=consumer, block_size=BLOCK,
                             salt=SALT, tp_size=tp_size, store=store,
                             kv_replicated=replicated)  # fmt: skip


def request(req_id="r1", prompt=PROMPT, **fields):
    """A vLLM ``Request``'s fields the half reads; ``fields``: ``lora_request``, ``cache_salt``,
    ``mm_features``, ``prompt_embeds``."""
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, **fields)


def image(identifier, offset=140, length=100):
    """A ``MultiModalFeatureSpec``: an image behind placeholder tokens 140..239 (block 1)."""
    return SimpleNamespace(identifier=identifier,
                           mm_position=SimpleNamespace(offset=offset, length=length))  # fmt: skip


SQL = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
# Request fields → the identity their keys must carry, and how many leading keys they share with
# the plain prompt's.
IDENTITIES = [
    ({"lora_request": SQL}, PromptIdentity(lora=("sql", "/adapters/sql")), 0),
    ({"cache_salt": "tenant-1"}, PromptIdentity(cache_salt="tenant-1"), 0),
    ({"mm_features": [image("img-a")]}, PromptIdentity(mm=(MMSpan("img-a", 140, 100),)), 1),
]


class Blocks:
    """vLLM's ``KVCacheBlocks`` for one group: ``ids`` in order, the first ``cached`` of them
    the local prefix cache's (they have a hash)."""

    def __init__(self, ids, cached=0):
        self.ids = ids
        self.blocks = ([SimpleNamespace(block_id=b, block_hash=b"h" if i < cached else None,
                                        is_null=b == 0) for i, b in enumerate(ids)],)  # fmt: skip

    def get_block_ids(self):
        return (self.ids,)


def step(new=(), cached=(), scheduled=None):
    """A SchedulerOutput: ``new`` = (req_id, prompt, block_ids, computed) tuples, ``cached`` =
    (req_id, new_block_ids, computed) tuples, ``scheduled`` = {req_id: tokens}."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, prompt_token_ids=p, block_ids=(b,), num_computed_tokens=c)
            for r, p, b, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            resumed_req_ids=set(),
            new_block_ids=[(b,) if b is not None else None for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
    )


@pytest.mark.parametrize(
    ("in_pool", "local", "claimed"),
    [
        (3, 0, 300),  # the whole prompt, partial tail included
        (3, 128, 172),  # beyond the local prefix cache only
        (2, 0, 256),  # the full blocks
        (1, 128, 0),  # the pool has nothing beyond the local cache
        (0, 0, 0),
    ],
)
def test_claims_the_leading_blocks_the_pool_holds(in_pool, local, claimed):
    store = DictStore(block_keys(DIGESTS[:in_pool], 0))
    h = half(store)
    assert h.get_num_new_matched_tokens(request(), local) == (claimed, claimed > 0)
    # One batched question, for the blocks beyond the local cache only.
    assert store.asked == [block_keys(DIGESTS[local // BLOCK :], 0)]


def test_every_tp_rank_must_hold_a_block():
    store = DictStore(block_keys(DIGESTS, 0) + block_keys(DIGESTS[:1], 1))
    h = half(store, tp_size=2)
    assert h.get_num_new_matched_tokens(request(), 0) == (128, True)


def test_kv_replicated_is_looked_up_once_whatever_the_tp_size():
    """MLA: one copy per engine, under rank 0; rank 1's keys are never asked for."""
    one_rank = half(DictStore(block_keys(DIGESTS, 0)), tp_size=1)
    store = DictStore(block_keys(DIGESTS, 0))
    h = half(store, tp_size=2, replicated=True)
    matched = h.get_num_new_matched_tokens(request(), 0)
    assert matched == one_rank.get_num_new_matched_tokens(request(), 0) and matched[0] > 0
    assert store.asked == [block_keys(DIGESTS, 0)]
    # Not replicated, the same pool holds rank 0's copy only: no block counts.
    assert half(DictStore(block_keys(DIGESTS, 0)), tp_size=2).get_num_new_matched_tokens(
        request(), 0
    ) == (0, False)


def test_the_load_names_digests_and_destination_blocks_and_is_claimed_once():
    h = half(DictStore(block_keys(DIGESTS, 0)))
    assert h.get_num_new_matched_tokens(request(), 128) == (172, True)
    h.update_state_after_alloc(request(), Blocks([7, 8, 9], cached=1), 172)
    meta = h.build_connector_meta(step())
    assert [(m.digests, m.block_ids) for m in meta.loads] == [(DIGESTS[1:], [8, 9])]
    assert h.get_num_new_matched_tokens(request(), 128) == (0, False)  # after the load: local
    assert h.build_connector_meta(step()).loads == []
    h.request_finished(request(), [])
    assert h.get_num_new_matched_tokens(request(), 128) == (172, True)  # a new request again


def test_vllm_trimming_the_claim_trims_the_load():
    h = half(DictStore(block_keys(DIGESTS, 0)))
    h.get_num_new_matched_tokens(request(), 0)
    h.update_state_after_alloc(request(), Blocks([4, 5, 6]), 256)
    assert h.build_connector_meta(step()).loads[0].block_ids == [4, 5]


def test_a_slow_pool_is_a_miss_within_lookup_timeout_s():
    gate = threading.Event()
    h = half(DictStore(block_keys(DIGESTS, 0), delay=gate), lookup_timeout_s=0.2)
    try:
        assert h.get_num_new_matched_tokens(request(), 0) == (0, False)
        # The stuck lookup is not queued behind: the next one is a miss at once.
        assert h.get_num_new_matched_tokens(request("r2"), 0) == (0, False)
        assert h.get_stats().data["lookup_failures"] == 2
    finally:
        gate.set()
        h.shutdown()


def test_a_producer_only_instance_never_looks_up():
    store = DictStore(block_keys(DIGESTS, 0))
    assert half(store, consumer=False).get_num_new_matched_tokens(request(), 0) == (0, False)
    assert store.asked == []


def test_saves_follow_chunked_prefill_and_end_with_the_partial_tail():
    h = half(None, consumer=False)
    h.update_state_after_alloc(request(), Blocks([3, 4]), 0)  # vLLM admits it, then steps
    # Step 1: 200 of 300 tokens computed: block 0 is complete.
    meta = h.build_connector_meta(step(new=[("r1", PROMPT, [3, 4], 0)], scheduled={"r1": 200}))
    assert [(s.digests, s.block_ids) for s in meta.saves] == [(DIGESTS[:1], [3])]
    # Step 2: the rest: block 1 and the 44-token tail.
    meta = h.build_connector_meta(step(cached=[("r1", [5], 200)], scheduled={"r1": 100}))
    assert [(s.digests, s.block_ids) for s in meta.saves] == [(DIGESTS[1:], [4, 5])]
    # Step 3: decode tokens: nothing more to save.
    assert h.build_connector_meta(step(cached=[("r1", None, 300)], scheduled={"r1": 1})).saves == []


def test_loaded_blocks_are_not_saved_again():
    h = half(DictStore(block_keys(DIGESTS[:2], 0)))
    h.get_num_new_matched_tokens(request(), 0)
    h.update_state_after_alloc(request(), Blocks([3, 4, 5]), 256)
    h.build_connector_meta(step())
    # The load ended: vLLM admits the request again (nothing more to load) and schedules it.
    h.update_state_after_alloc(request(), Blocks([3, 4, 5]), 0)
    meta = h.build_connector_meta(step(new=[("r1", PROMPT, [3, 4, 5], 256)], scheduled={"r1": 44}))
    assert [(s.digests, s.block_ids) for s in meta.saves] == [(DIGESTS[2:], [5])]


def test_a_consumer_only_instance_saves_nothing():
    h = half(DictStore(), producer=False)
    h.update_state_after_alloc(request(), Blocks([3, 4, 5]), 0)
    assert (
        h.build_connector_meta(
            step(new=[("r1", PROMPT, [3, 4, 5], 0)], scheduled={"r1": 300})
        ).saves
        == []
    )


class FakeEngineCore:
    """``vllm_glue.EngineCoreHandle``'s surface: counts rests and wake-ups."""

    def __init__(self, busy=False):
        self.busy, self.rests, self.wakes = busy, 0, 0

    def busy_with_others(self, ours=()):
        return self.busy

    def rest(self, woken, timeout_s=2.0):
        self.rests += 1

    def wake(self):
        self.wakes += 1


def test_while_only_loads_are_pending_vllm_rests_until_a_worker_says_one_ended():
    """Stepping every 2 ms while a load ran kept the decode's worker spinning beside the get's
    own spin, and starved the holder's store threads on a 2-core host (docs/pool.md, Stalls)."""
    import os
    import time

    from mooncake_vllm.p2p.local_channels import WakeSender

    endpoint = f"ipc://@mooncake-vllm-test/pool/{os.getpid()}/wake"
    core = FakeEngineCore()
    h = PoolSchedulerHalf(
        half(DictStore())._settings, is_producer=False, is_consumer=True, block_size=BLOCK,
        salt=SALT, tp_size=1, store=DictStore(), engine_core=core, wake_endpoint=endpoint,
    )  # fmt: skip
    idle = step()
    idle.finished_req_ids = set()
    try:
        h.build_connector_meta(idle)
        assert core.rests == 0  # nothing pinned: no load is pending
        h._pins = [object()]  # a load in flight (BlockPins holds its blocks)
        h.build_connector_meta(idle)
        assert core.rests == 1
        sender = WakeSender(endpoint)
        sender.wake()  # the load ended: the next step must not wait for another wake-up
        deadline = time.monotonic() + 5
        while core.wakes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.wakes == 1
        h.build_connector_meta(idle)
        assert core.rests == 1
        core.busy = True  # a running request or a queued one: vLLM must step
        h.build_connector_meta(idle)
        assert core.rests == 1
        sender.close()
    finally:
        h.shutdown()


@pytest.mark.parametrize(("fields", "identity", "shared"), IDENTITIES)
def test_lookups_ask_for_the_keys_of_the_adapter_the_images_and_the_salt(fields, identity, shared):
    """A pool holding the plain prompt's KV must not serve it to another adapter, image or
    tenant: vLLM's own prefix cache keys carry all three."""
    store = DictStore(block_keys(DIGESTS, 0))
    h = half(store)
    assert h.get_num_new_matched_tokens(request(**fields), 0) == (
        (shared * BLOCK, True) if shared else (0, False)
    )
    keys = block_keys(chain_digests(PROMPT, BLOCK, SALT, identity), 0)
    assert store.asked == [keys]
    assert keys[:shared] == block_keys(DIGESTS, 0)[:shared]
    # The same request again finds what a request like it saved.
    h = half(DictStore(keys))
    assert h.get_num_new_matched_tokens(request(**fields), 0) == (300, True)


def test_two_adapters_or_two_tenants_never_meet_in_the_pool():
    asked = {}
    for name, fields in [
        ("sql", {"lora_request": SQL}),
        ("chat", {"lora_request": SimpleNamespace(lora_name="chat", lora_int_id=1,
                                                   lora_path="/adapters/chat")}),
        ("t1", {"cache_salt": "t1"}),
        ("t2", {"cache_salt": "t2"}),
        ("img-a", {"mm_features": [image("img-a")]}),
        ("img-b", {"mm_features": [image("img-b")]}),
    ]:  # fmt: skip
        store = DictStore()
        half(store).get_num_new_matched_tokens(request(**fields), 0)
        asked[name] = store.asked[0]
    for a, b, shared in [("sql", "chat", 0), ("t1", "t2", 0), ("img-a", "img-b", 1)]:
        assert asked[a][:shared] == asked[b][:shared]
        assert not set(asked[a][shared:]) & set(asked[b]), (a, b)


@pytest.mark.parametrize(("fields", "identity", "shared"), IDENTITIES)
def test_saves_are_keyed_by_the_identity_read_when_vllm_admits_the_request(
    fields, identity, shared
):
    h = half(None, consumer=False)
    h.update_state_after_alloc(request(**fields), Blocks([3, 4, 5]), 0)
    meta = h.build_connector_meta(step(new=[("r1", PROMPT, [3, 4, 5], 0)], scheduled={"r1": 300}))
    assert [s.digests for s in meta.saves] == [chain_digests(PROMPT, BLOCK, SALT, identity)]
    assert meta.saves[0].digests[:shared] == DIGESTS[:shared]
    assert meta.saves[0].digests[shared] != DIGESTS[shared]


def test_a_request_whose_identity_was_not_read_is_not_saved():
    """vLLM's ``NewRequestData`` has no ``cache_salt``: keys made from it alone could hand a
    tenant's KV to another, so a request ``update_state_after_alloc`` never saw is skipped."""
    h = half(None, consumer=False)
    meta = h.build_connector_meta(step(new=[("r1", PROMPT, [3, 4, 5], 0)], scheduled={"r1": 300}))
    assert meta.saves == []


def test_a_prompt_of_embeddings_is_neither_looked_up_nor_saved():
    store = DictStore(block_keys(DIGESTS, 0))
    h = half(store)
    embeds = request(prompt_embeds=object())  # with placeholder ids beside the embeddings
    assert h.get_num_new_matched_tokens(embeds, 0) == (0, False)
    assert store.asked == []
    h.update_state_after_alloc(embeds, Blocks([3, 4, 5]), 0)
    meta = h.build_connector_meta(step(new=[("r1", PROMPT, [3, 4, 5], 0)], scheduled={"r1": 300}))
    assert meta.saves == []


def test_a_real_vllm_request_is_read_the_same():
    """The fields' names and shapes are vLLM's own (``Request``, ``LoRARequest``,
    ``MultiModalFeatureSpec``), not only this file's stubs."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    real = Request(
        "r1", PROMPT, SamplingParams(max_tokens=1), None,
        lora_request=LoRARequest("sql", 3, "/adapters/sql"), cache_salt="tenant-1",
        mm_features=[MultiModalFeatureSpec(data=None, modality="image", identifier="img-a",
                                           mm_position=PlaceholderRange(offset=140, length=100))],
    )  # fmt: skip
    identity = PromptIdentity(
        lora=("sql", "/adapters/sql"), mm=(MMSpan("img-a", 140, 100),), cache_salt="tenant-1"
    )
    store = DictStore()
    half(store).get_num_new_matched_tokens(real, 0)
    assert store.asked == [block_keys(chain_digests(PROMPT, BLOCK, SALT, identity), 0)]


# ---- a hybrid model: a full-attention group and a sliding-window group (core.kv_groups) -----

FULL = KVGroup(("layers.2",))
SLIDING = KVGroup(("layers.0", "layers.1"), sliding_window=128)
HYBRID_PROMPT = list(range(100, 740))  # 640 tokens: five full blocks


def hybrid_half(store, **kwargs):
    h = half(store, **kwargs)
    return PoolSchedulerHalf(
        h._settings, is_producer=h._is_producer, is_consumer=h._is_consumer, block_size=BLOCK,
        salt=SALT, tp_size=1, store=store, kv_groups=(FULL, SLIDING),
    )  # fmt: skip


def hybrid_keys(full_blocks, sliding_blocks):
    digests = chain_digests(HYBRID_PROMPT, BLOCK, SALT)
    return block_keys([digests[i] for i in full_blocks], 0, 0) + block_keys(
        [digests[i] for i in sliding_blocks], 0, 1
    )


def test_a_hybrid_lookup_needs_the_full_groups_blocks_and_the_windows_only():
    """Claimed one token short (the last prompt token is computed, as the pair's claim): the
    load ends at token 639, whose window reaches back to token 512, block 4."""
    store = DictStore(hybrid_keys(range(5), [4]))
    h = hybrid_half(store)
    assert h.get_num_new_matched_tokens(request(prompt=HYBRID_PROMPT), 0) == (639, True)
    (asked,) = store.asked
    assert len(asked) == 10 and asked[5:] == hybrid_keys([], range(5))  # every group's keys
    # The window's block missing: the claim is cut back to where the window's blocks are there.
    store = DictStore(hybrid_keys(range(5), [2, 3]))
    assert hybrid_half(store).get_num_new_matched_tokens(request(prompt=HYBRID_PROMPT), 0) == (
        512,
        True,
    )
    # A full group's block missing cuts the claim there.
    store = DictStore(hybrid_keys([0, 1], range(5)))
    assert hybrid_half(store).get_num_new_matched_tokens(request(prompt=HYBRID_PROMPT), 0) == (
        256,
        True,
    )


class HybridBlocks:
    """``KVCacheBlocks`` of two groups: the full group's ids, and the sliding group's, where 0
    is vLLM's null block (a position the window skips)."""

    def __init__(self, full, sliding):
        def group(ids):
            return [SimpleNamespace(block_id=b, block_hash=None, is_null=b == 0) for b in ids]

        self.blocks = (group(full), group(sliding))


def test_a_hybrid_load_fills_each_groups_allocated_blocks_from_its_own_keys():
    h = hybrid_half(DictStore(hybrid_keys(range(5), range(5))))
    assert h.get_num_new_matched_tokens(request(prompt=HYBRID_PROMPT), 0) == (639, True)
    h.update_state_after_alloc(
        request(prompt=HYBRID_PROMPT), HybridBlocks([11, 12, 13, 14, 15], [0, 0, 0, 0, 25]), 639
    )
    loads = h.build_connector_meta(step()).loads
    digests = chain_digests(HYBRID_PROMPT, BLOCK, SALT)
    assert [(m.group, m.digests, m.block_ids) for m in loads] == [
        (0, digests, [11, 12, 13, 14, 15]),
        (1, digests[4:], [25]),  # the window's block only
    ]


def test_a_hybrid_load_vllm_cannot_fill_is_reported_failed_not_raised():
    h = hybrid_half(DictStore(hybrid_keys(range(5), range(5))))
    h.get_num_new_matched_tokens(request(prompt=HYBRID_PROMPT), 0)
    holes = HybridBlocks([11, 12, 13, 14, 15], [21, 0, 0, 0, 25])  # not contiguous
    h.update_state_after_alloc(request(prompt=HYBRID_PROMPT), holes, 639)
    (load,) = h.build_connector_meta(step()).loads
    assert "not contiguous" in load.error


def test_hybrid_saves_are_per_group_and_skip_the_null_block():
    h = hybrid_half(None, consumer=False)
    h.update_state_after_alloc(request(prompt=HYBRID_PROMPT), HybridBlocks([], []), 0)
    # Admitted with a local prefix-cache hit of 512 tokens: the window freed blocks 0..2.
    new = SimpleNamespace(
        req_id="r1", prompt_token_ids=HYBRID_PROMPT, num_computed_tokens=512,
        block_ids=([11, 12, 13, 14, 15], [0, 0, 0, 24, 25]),
    )  # fmt: skip
    out = step(scheduled={"r1": 128})
    out.scheduled_new_reqs = [new]
    saves = h.build_connector_meta(out).saves
    digests = chain_digests(HYBRID_PROMPT, BLOCK, SALT)
    assert [(s.group, s.digests, s.block_ids) for s in saves] == [
        (0, digests, [11, 12, 13, 14, 15]),
        (1, digests[3:], [24, 25]),
    ]
