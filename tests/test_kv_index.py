"""KV-event routing's pure parts: events in, each engine's cached prefix and the choice out."""

from __future__ import annotations

import msgspec
import pytest

from mooncake_vllm.proxy import kv_index, prefix
from mooncake_vllm.proxy.kv_index import KvIndex, block_keys

BS = 4  # block size of the engines below
P0, P1, P2 = "http://p0:1", "http://p1:1", "http://p2:1"
URLS = (P0, P1, P2)
RING = prefix.Ring.of(URLS)


def stored(tokens, hashes, parent=None, block_size=BS, **extra):
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        **extra,
    }


def removed(*hashes):
    return {"type": "BlockRemoved", "block_hashes": list(hashes)}


CLEARED = {"type": "AllBlocksCleared"}
PROMPT = list(range(100, 116))  # 4 blocks
OTHER = list(range(200, 216))


def test_block_keys_chain_over_every_earlier_token():
    keys = block_keys(PROMPT, BS)
    assert len(keys) == 4
    assert block_keys(PROMPT[:9], BS) == keys[:2]  # a partial block has no key
    # The same block after another history is another key.
    assert block_keys([*OTHER[:4], *PROMPT[4:8]], BS)[1] != keys[1]
    assert block_keys(PROMPT[4:8], BS, parent=keys[0]) == [keys[1]]


# Each case: events per engine (in order), the prompt, the tokens each engine is expected to hold
# as a leading run of the prompt.
CASES = {
    "one event, all blocks": ([(P0, stored(PROMPT, [1, 2, 3, 4]))], PROMPT, {P0: 16, P1: 0}),
    "stored in steps, chained by parent hash": (
        [(P0, stored(PROMPT[:8], [1, 2])), (P0, stored(PROMPT[8:12], [3], parent=2))],
        PROMPT,
        {P0: 12},
    ),
    "a longer prompt matches the held run": (
        [(P0, stored(PROMPT[:8], [1, 2]))],
        [*PROMPT, 5, 6],
        {P0: 8},
    ),
    "a diverging prompt matches up to the divergence": (
        [(P0, stored(PROMPT, [1, 2, 3, 4]))],
        [*PROMPT[:6], 9, 9, *PROMPT[8:]],
        {P0: 4},
    ),
    "removed tail shortens the run": (
        [(P0, stored(PROMPT, [1, 2, 3, 4])), (P0, removed(3, 4))],
        PROMPT,
        {P0: 8},
    ),
    "removed head ends the run (vLLM's lookup stops at the first miss)": (
        [(P0, stored(PROMPT, [1, 2, 3, 4])), (P0, removed(1))],
        PROMPT,
        {P0: 0},
    ),
    "all cleared": ([(P0, stored(PROMPT, [1, 2, 3, 4])), (P0, CLEARED)], PROMPT, {P0: 0}),
    "engines apart": (
        [(P0, stored(PROMPT[:4], [1])), (P1, stored(PROMPT, [7, 8, 9, 10]))],
        PROMPT,
        {P0: 4, P1: 16, P2: 0},
    ),
    "a clear on one engine leaves the other": (
        [(P0, stored(PROMPT, [1, 2, 3, 4])), (P1, stored(PROMPT, [1, 2, 3, 4])), (P1, CLEARED)],
        PROMPT,
        {P0: 16, P1: 0},
    ),
    "unknown parent (events before we listened): not keyed": (
        [(P0, stored(PROMPT[4:8], [2], parent=1))],
        PROMPT,
        {P0: 0},
    ),
    "reported again as a cache hit: one copy, one removal ends it": (
        [(P0, stored(PROMPT[:4], [1])), (P0, stored(PROMPT[:4], [1])), (P0, removed(1))],
        PROMPT,
        {P0: 0},
    ),
    "two vLLM hashes for one token block (cache salt): held until both go": (
        [(P0, stored(PROMPT[:4], [1])), (P0, stored(PROMPT[:4], [11])), (P0, removed(1))],
        PROMPT,
        {P0: 4},
    ),
    "bytes hashes (vLLM's default) work as ints do": (
        [(P0, stored(PROMPT[:8], [b"a" * 32, b"b" * 32])), (P0, removed(b"b" * 32))],
        PROMPT,
        {P0: 4},
    ),
    "another KV cache group is ignored": (
        [(P0, stored(PROMPT, [1, 2, 3, 4], group_idx=1))],
        PROMPT,
        {P0: 0},
    ),
    "tokens not whole blocks: ignored": ([(P0, stored(PROMPT[:6], [1]))], PROMPT, {P0: 0}),
    "a removal of an unknown hash is harmless": (
        [(P0, stored(PROMPT[:4], [1])), (P0, removed(99))],
        PROMPT,
        {P0: 4},
    ),
}


@pytest.mark.parametrize(("events", "prompt", "expected"), CASES.values(), ids=CASES.keys())
def test_events_in_cached_prefix_out(events, prompt, expected):
    index = KvIndex()
    for url, event in events:
        index.apply(url, event)
    assert index.matched_tokens(prompt, expected.keys()) == expected


# ---- the choice ---------------------------------------------------------------------------------

KEY = b"some prefix"


@pytest.mark.parametrize(
    ("matched", "in_flight", "expected"),
    [
        # The longest cached prefix wins, whatever the ring says.
        ({P0: 0, P1: 64, P2: 16}, {}, P1),
        ({P0: 32, P1: 64, P2: 64}, {P1: 1}, P2),  # equal matches: fewer in flight
        ({P0: 32, P1: 64, P2: 64}, {}, P1),  # equal and equally loaded: first in order
        # Over the cap (load factor 2, 6 in flight over 3: cap ceil(2 * 7 / 3) = 5): passed over.
        ({P0: 0, P1: 64, P2: 16}, {P1: 5, P0: 1}, P2),
        # Nothing cached below the cap: the ring's choice (today's --policy prefix).
        ({P0: 0, P1: 0, P2: 0}, {}, prefix.choose(RING, KEY, {}, URLS)),
        ({}, {}, prefix.choose(RING, KEY, {}, URLS)),
    ],
)
def test_choice(matched, in_flight, expected):
    assert kv_index.choose(matched, in_flight, URLS, RING, KEY) == expected


def test_choice_without_key_or_eligible():
    assert kv_index.choose({}, {P0: 2, P1: 0, P2: 1}, URLS, RING, None) == P1
    assert kv_index.choose({P0: 8}, {}, [], RING, KEY) is None
    assert kv_index.choose({P0: 64}, {}, [P1, P2], RING, KEY) in (P1, P2)  # P0 not eligible


def test_index_drives_choice_turn_by_turn():
    """A chat's second turn goes where its first turn's blocks are; another chat spreads."""
    index = KvIndex()
    turn1 = PROMPT[:8]
    index.apply(P2, stored(turn1, [5, 6]))
    turn2 = [*turn1, *PROMPT[8:]]
    matched = index.matched_tokens(turn2, URLS)
    assert kv_index.choose(matched, {}, URLS, RING, KEY) == P2
    # The engine evicted it: back to the ring.
    index.apply(P2, removed(5))
    matched = index.matched_tokens(turn2, URLS)
    assert kv_index.choose(matched, {}, URLS, RING, KEY) == prefix.choose(RING, KEY, {}, URLS)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": [1, 2, 3]}, [1, 2, 3]),
        ({"prompt": [[1, 2], [3]]}, [1, 2]),
        ({"prompt": "text"}, None),
        ({"prompt": ["text", "more"]}, None),
        ({"messages": [{"role": "user", "content": "hi"}]}, None),
        ({"prompt": []}, None),
    ],
)
def test_prompt_token_ids(body, expected):
    assert kv_index.prompt_token_ids(body) == expected


@pytest.mark.parametrize(
    ("event_extra", "ask", "expected"),
    [
        # A LoRA adapter's blocks answer a request naming that adapter only.
        ({"lora_name": "ad-a", "extra_keys": [["ad-a"], ["ad-a"]]}, ("ad-a", None), 8),
        ({"lora_name": "ad-a", "extra_keys": [["ad-a"], ["ad-a"]]}, ("ad-b", None), 0),
        ({"lora_name": "ad-a", "extra_keys": [["ad-a"], ["ad-a"]]}, ("base", None), 0),
        # The base model's blocks answer any model name but an adapter seen in events.
        ({}, ("base", None), 8),
        ({}, ("an-alias", None), 8),
        ({}, ("ad-a", None), 0),
        # A cache_salt (on the prompt's first block) keeps its blocks to requests with it.
        ({"extra_keys": [["tenant-1"], None]}, ("base", "tenant-1"), 8),
        ({"extra_keys": [["tenant-1"], None]}, ("base", "tenant-2"), 0),
        ({"extra_keys": [["tenant-1"], None]}, ("base", None), 0),
        ({}, ("base", "tenant-1"), 0),
        # Both, and a multimodal pair before the salt.
        ({"lora_name": "ad-a", "extra_keys": [["ad-a", ["img", 0], "t1"], ["ad-a"]]},
         ("ad-a", "t1"), 8),
        ({"lora_name": "ad-a", "extra_keys": [["ad-a", ["img", 0], "t1"], ["ad-a"]]},
         ("ad-a", None), 0),
    ],
)  # fmt: skip
def test_an_adapters_or_a_salts_blocks_answer_only_requests_with_it(event_extra, ask, expected):
    index = KvIndex()
    if event_extra.get("lora_name") != "ad-a":  # "ad-a" is an adapter this engine serves
        index.apply(P1, stored(OTHER[:4], [9], lora_name="ad-a"))
    index.apply(P0, stored(PROMPT[:8], [1, 2], **event_extra))
    assert index.matched_tokens(PROMPT, [P0], *ask) == {P0: expected}


def test_a_request_names_its_model_and_salt_for_kv_routing():
    body = {"model": "ad-a", "cache_salt": "t1", "prompt": [1, 2]}
    assert prefix.prompt_identity(body) == ("ad-a", "t1")
    assert prefix.prompt_identity({"model": 3, "cache_salt": ["x"]}) == (None, None)


# ---- the pool and the subscription --------------------------------------------------------------


def test_pool_routes_both_roles_by_cache():
    from mooncake_vllm.proxy.routing import BackendPool, Policy

    index = KvIndex()
    index.apply(P1, stored(PROMPT[:8], [1, 2]))
    pool = BackendPool("decode", URLS, Policy.KV, cache=index)
    assert pool.pick(key=KEY, token_ids=PROMPT).url == P1
    p1 = pool.backends[1]
    assert pool.pick(exclude=[p1], key=KEY, token_ids=PROMPT).url != P1  # failover goes on
    # Ids unknown (a text prompt): the ring, as --policy prefix.
    assert pool.pick(key=KEY).url == prefix.choose(RING, KEY, {}, URLS)


def test_subscriber_clears_an_engine_on_a_gap_or_restart():
    from mooncake_vllm.proxy.kv_events import KvEventSubscriber

    index = KvIndex()
    sub = KvEventSubscriber(index, {P0: "tcp://127.0.0.1:1"})

    def send(seq, *events):
        payload = msgspec.msgpack.encode([0.0, list(events), None])
        sub.receive(P0, [b"", seq.to_bytes(8, "big"), payload])

    send(7, stored(PROMPT[:4], [1]))  # the first heard: whatever came before is unknown
    send(8, stored(PROMPT[4:8], [2], parent=1))
    assert index.matched_tokens(PROMPT, [P0]) == {P0: 8}
    send(10)  # 9 was lost: its removals may be among them
    assert index.matched_tokens(PROMPT, [P0]) == {P0: 0}
    send(11, stored(PROMPT[:4], [1]))
    send(0)  # the engine restarted
    assert index.matched_tokens(PROMPT, [P0]) == {P0: 0}
    sub.receive(P0, [b"not", b"three frames"])
    assert (sub.streams[P0].gaps, sub.streams[P0].bad_messages) == (2, 1)


async def test_subscriber_over_zmq():
    """A real PUB socket publishing as vLLM does; the subscriber's index learns the blocks."""
    import asyncio

    import zmq

    from mooncake_vllm.proxy.kv_events import KvEventSubscriber

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = KvIndex()
    sub = KvEventSubscriber(index, {P0: f"tcp://127.0.0.1:{port}"})
    sub.start()
    try:
        payload = msgspec.msgpack.encode([0.0, [stored(PROMPT, [1, 2, 3, 4])], None])
        for _ in range(200):  # a SUB joins late: publish until it hears (the slow joiner)
            pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])
            await asyncio.sleep(0.01)
            if index.matched_tokens(PROMPT, [P0])[P0]:
                break
        assert index.matched_tokens(PROMPT, [P0]) == {P0: 16}
    finally:
        await sub.stop()
        pub.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    ("prompts", "bound"),
    [
        ([[1] * 256], 256),  # nothing seen before: all of it
        ([list(range(300)), list(range(400))], 300 + 400 - 256),  # 2 leading blocks reused
        ([list(range(256)), list(range(256))], 256 + 128),  # the last token is always computed
        ([list(range(256)), [9, *range(1, 256)]], 512),  # another first block: nothing reused
    ],
)
def test_reuse_bound_of_a_workload(prompts, bound):
    from benchmarks.kv_routing import reuse_bound

    assert reuse_bound(prompts, 128) == bound


# Share (step 3): with two engines, P0 with 12 of the last 16 picks has excess 0.5, so a request
# may give up 2.5 * 0.5 = 1.25 x its prompt; with 9 of 16, excess 0.125: up to 0.31 x.
@pytest.mark.parametrize(
    ("matched", "recent", "prompt_tokens", "expected"),
    [
        ({P0: 512}, {P0: 9, P1: 7}, 712, P0),  # 512 > 0.31 * 712: stays with its system prompt
        ({P0: 512}, {P0: 12, P1: 4}, 712, P1),  # far over its share: moves, recomputes 512
        ({P0: 640, P1: 512}, {P0: 9, P1: 7}, 900, P1),  # gives up 128 of 900: moves
        ({P0: 640, P1: 512}, {P0: 8, P1: 8}, 900, P0),  # fair share: the longest prefix
        ({P0: 512, P1: 512}, {P0: 9, P1: 7}, 712, P1),  # a tie: the less used
        ({P0: 512}, {P0: 5, P1: 1}, 712, P0),  # too few picks to judge a share
        ({P0: 512}, {P0: 12, P1: 4}, 0, P0),  # ids unknown: no share step
        ({}, {P0: 9, P1: 7}, 712, P1),  # nothing cached: nothing given up
    ],
)
def test_share_weighs_against_cache(matched, recent, prompt_tokens, expected):
    urls = (P0, P1)
    ring = prefix.Ring.of(urls)
    key = next(k for k in (b"a", b"b", b"c", b"d") if prefix.choose(ring, k, {}, urls) == P0)
    got = kv_index.choose(
        matched, {}, urls, ring, key, recent_picks=recent, prompt_tokens=prompt_tokens
    )
    assert got == expected


def test_pool_spreads_chats_under_one_system_prompt():
    """Low concurrency, one system prompt cached on P0: without the share step every chat would
    follow it; with it, P0 keeps at most ~60 % of them."""
    from mooncake_vllm.proxy.routing import BackendPool, Policy

    index = KvIndex()
    pool = BackendPool("prefill", (P0, P1), Policy.KV, cache=index)
    system = list(range(5000, 5512))
    hashes = iter(range(10**6))
    picked = []
    for chat in range(40):
        prompt = [*system, *range(chat * 1000, chat * 1000 + 200)]
        url = pool.pick(key=b"system", token_ids=prompt).url
        picked.append(url)
        n = len(prompt) // 128  # the engine caches the prompt's full blocks
        index.apply(url, stored(prompt[: n * 128], [next(hashes) for _ in range(n)], None, 128))
    assert 0.4 <= picked.count(P0) / len(picked) <= 0.6, picked


# The cost model with a queue weight of 0.5: miss + 0.5 x queued + 2.5 x excess share x P, the
# least wins (two engines). The pools' own weights are ``QUEUE_WEIGHT`` (tested below).
@pytest.mark.parametrize(
    ("matched", "queued", "recent", "prompt_tokens", "expected", "why"),
    [
        ({P0: 512}, {}, {}, 712, P0, "idle: 200 to compute on P0 against 712 on P1"),
        ({P0: 512}, {P0: 600}, {}, 712, P0, "200 + 600 / 2 queued = 500 < 712"),
        ({P0: 512}, {P0: 1100}, {}, 712, P1, "200 + 550 = 750 > 712: the wait costs more"),
        ({P0: 512}, {P0: 1100, P1: 200}, {}, 712, P0, "750 < 712 + 100"),
        ({P0: 128}, {P0: 1000}, {}, 1600, P1, "a new chat's system block is not worth a queue"),
        ({}, {P1: 10}, {}, 712, P0, "nothing cached anywhere: the shorter queue"),
        ({P0: 512}, {P0: 300}, {P0: 12, P1: 4}, 712, P1, "queue and share add up: 1240 > 712"),
        ({P0: 512, P1: 512}, {P0: 1}, {}, 712, P1, "equal caches: one queued token decides"),
    ],
)
def test_cost_model(matched, queued, recent, prompt_tokens, expected, why):
    urls = (P0, P1)
    ring = prefix.Ring.of(urls)
    got = kv_index.choose(
        matched, {}, urls, ring, KEY, recent_picks=recent, prompt_tokens=prompt_tokens,
        queued_tokens=queued, queue_weight=0.5,
    )  # fmt: skip
    assert got == expected, why


def test_a_decodes_queue_is_not_charged():
    """Queued pulls do not move a decode leg off the engine holding the prompt's history."""
    urls = (P0, P1)
    got = kv_index.choose(
        {P0: 512}, {}, urls, prefix.Ring.of(urls), KEY, prompt_tokens=712,
        queued_tokens={P0: 5000}, queue_weight=kv_index.QUEUE_WEIGHT["decode"],
    )  # fmt: skip
    assert got == P0


def test_cost_terms():
    (a, b) = kv_index.costs(712, {P0: 512}, {P0: 40}, {P0: 12, P1: 4}, [P0, P1], 0.5)
    assert (a.url, a.miss, a.queued, a.share) == (P0, 200, 20, 2.5 * 0.5 * 712)
    assert a.total == 200 + 20 + 2.5 * 0.5 * 712
    assert (b.miss, b.queued, b.share) == (712, 0, 0.0)
    # Under MIN_RECENT_PICKS picks, or with one engine, no share is judged.
    assert kv_index.costs(712, {}, {}, {P0: 5, P1: 1}, [P0, P1])[0].share == 0.0
    assert kv_index.costs(712, {}, {}, {P0: 50}, [P0])[0].share == 0.0


def test_equal_costs_follow_the_ring():
    """Two equal prompts with nothing cached, sent together, agree on the engine."""
    urls = (P0, P1, P2)
    ring = prefix.Ring.of(urls)
    got = {kv_index.choose({}, {}, urls, ring, KEY, prompt_tokens=300) for _ in range(3)}
    assert got == {prefix.choose(ring, KEY, {}, urls)}


def test_the_pool_counts_each_legs_tokens_while_in_flight():
    """A pick charges its engine the tokens it must compute there, until the leg ends; the
    next request for the same cached prefix goes elsewhere once that queue costs more."""
    from mooncake_vllm.proxy.routing import BackendPool, Policy

    weight = kv_index.QUEUE_WEIGHT["prefill"]
    assert weight > 0
    index = KvIndex()
    pool = BackendPool("prefill", (P0, P1), Policy.KV, cache=index)
    system = list(range(5000, 5512))
    index.apply(P0, stored(system, [1, 2, 3, 4], None, 128))
    # A first leg long enough that its queue outweighs the second's cache hit on P0:
    # 900 to compute + weight x queued > 1412 on P1.
    suffix = int(600 / weight) + 128
    first = pool.pick(token_ids=[*system, *range(suffix)])
    assert first.url == P0
    charged = pool.begin(first)
    assert charged == first.tokens_in_flight == suffix
    second = pool.pick(token_ids=[*system, *range(10**5, 10**5 + 900)])
    assert second.url == P1
    pool.begin(second)
    pool.end(first, charged)
    assert first.tokens_in_flight == 0 and first.in_flight == 0
    third = pool.pick(token_ids=[*system, *range(2 * 10**5, 2 * 10**5 + 900)])
    assert third.url == P0
