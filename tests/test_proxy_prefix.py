"""Prefix-aware routing's pure parts: the key of a request, and the bounded-load hash ring."""

from __future__ import annotations

from collections import Counter

import pytest

from mooncake_vllm.proxy import prefix
from mooncake_vllm.proxy.routing import BackendPool, Policy

URLS = ("http://p0:1", "http://p1:1", "http://p2:1")
SYSTEM_A = "You are a careful assistant for the A team. " * 8  # > PREFIX_KEY_CHARS
SYSTEM_B = "You answer questions about the B product. " * 8


def _chat(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"messages": messages}


# ---- the key ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second", "same"),
    [
        # Completions: the leading characters decide.
        ({"prompt": "x" * 300 + "tail one"}, {"prompt": "x" * 300 + "tail two"}, True),
        ({"prompt": "short one"}, {"prompt": "short two"}, False),
        ({"prompt": ["x" * 300 + "a", "b"]}, {"prompt": "x" * 300 + "c"}, True),  # batch: first
        # Text prompts shorter than the key: the whole prompt decides.
        ({"prompt": "Q: one"}, {"prompt": "Q: one A: x Q: two"}, False),
        # Token ids: the leading PREFIX_KEY_TOKENS ids.
        ({"prompt": list(range(100))}, {"prompt": [*range(64), 7, 7]}, True),
        ({"prompt": list(range(100))}, {"prompt": [1, *range(99)]}, False),
        ({"prompt": [0, 1, 2]}, {"prompt": "0,1,2"}, False),  # ids never collide with text
        # Chats: every turn of a chat and every chat under a long system prompt share a key.
        (_chat(SYSTEM_A, "hi"), _chat(SYSTEM_A, "hi", "hello", "more"), True),
        (_chat(SYSTEM_A, "hi"), _chat(SYSTEM_A, "something else"), True),
        (_chat(SYSTEM_A, "hi"), _chat(SYSTEM_B, "hi"), False),
        # A short system prompt: the first user turn tells chats apart, turns still stay.
        (_chat("Be brief.", "question one"), _chat("Be brief.", "question one", "a", "b"), True),
        (_chat("Be brief.", "question one"), _chat("Be brief.", "question two"), False),
        # The same text split differently over messages is another prompt.
        (_chat("ab", "c"), _chat("a", "bc"), False),
        # List-of-parts content counts its text parts.
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}]},
            {"messages": [{"role": "user", "content": "hey"}]},
            True,
        ),
    ],
)
def test_prefix_key(first, second, same):
    assert (prefix.prefix_key(first) == prefix.prefix_key(second)) is same


def test_prefix_key_is_bounded_and_absent_without_a_prompt():
    assert len(prefix.prefix_key({"prompt": "y" * 10_000})) == prefix.PREFIX_KEY_CHARS
    named = {"prompt": "y" * 10_000, "model": "m" * 5000, "cache_salt": "s" * 5000}
    assert len(prefix.prefix_key(named)) == prefix.PREFIX_KEY_CHARS + 16
    assert prefix.prefix_key({"model": "m"}) is None


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    ("first", "second", "same"),
    [
        # The model a request names: two LoRA adapters (or a base model and an adapter) keep
        # the same prompt's KV apart in vLLM's prefix cache.
        ({"model": "ad-a", "prompt": "p" * 300}, {"model": "ad-a", "prompt": "p" * 300}, True),
        ({"model": "ad-a", "prompt": "p" * 300}, {"model": "ad-b", "prompt": "p" * 300}, False),
        # A cache_salt keeps one tenant's KV from another's; none is not a salt.
        ({"prompt": "p", "cache_salt": "t1"}, {"prompt": "p", "cache_salt": "t1"}, True),
        ({"prompt": "p", "cache_salt": "t1"}, {"prompt": "p", "cache_salt": "t2"}, False),
        ({"prompt": "p", "cache_salt": "t1"}, {"prompt": "p"}, False),
        ({"prompt": "p", "cache_salt": ""}, {"prompt": "p"}, True),
        # An image is part of the prompt, not left out with the text parts only.
        (
            {"messages": [{"role": "user", "content": [_image("http://x/1.png")]}]},
            {"messages": [{"role": "user", "content": [_image("http://x/2.png")]}]},
            False,
        ),
        (
            {"messages": [{"role": "user", "content": [_image("http://x/1.png")]}]},
            {"messages": [{"role": "user", "content": [_image("http://x/1.png")]}]},
            True,
        ),
    ],
)
def test_prefix_key_carries_what_vllms_prefix_cache_keys_by(first, second, same):
    assert (prefix.prefix_key(first) == prefix.prefix_key(second)) is same


# ---- the ring -----------------------------------------------------------------------------------

RING = prefix.Ring.of(URLS)
KEYS = [f"system prompt {i}".encode() for i in range(600)]


def test_same_key_same_backend_and_keys_spread_evenly():
    idle = dict.fromkeys(URLS, 0)
    first = [prefix.choose(RING, k, idle, URLS) for k in KEYS]
    assert first == [prefix.choose(RING, k, idle, URLS) for k in KEYS]
    shares = Counter(first)
    assert set(shares) == set(URLS)
    assert all(100 <= n <= 300 for n in shares.values()), shares  # 200 each when even


def test_removing_a_backend_moves_only_its_keys():
    idle = dict.fromkeys(URLS, 0)
    before = {k: prefix.choose(RING, k, idle, URLS) for k in KEYS}
    survivors = URLS[:2]
    after = {k: prefix.choose(RING, k, idle, survivors) for k in KEYS}
    assert all(after[k] == before[k] for k in KEYS if before[k] in survivors)
    assert all(after[k] in survivors for k in KEYS)
    rebuilt = prefix.Ring.of(survivors)  # the pool's ring after the member left
    assert all(prefix.choose(rebuilt, k, idle, survivors) == after[k] for k in KEYS)


@pytest.mark.parametrize(
    ("in_flight", "eligible", "load_factor", "expected"),
    [
        # Under capacity: the key's own backend.
        ({}, URLS, 1.25, "owner"),
        # 1 in flight in all: cap = ceil(1.25 * 2 / 3) = 1, so the owner is full.
        ({"owner": 1}, URLS, 1.25, "next"),
        # The owner holds more than load_factor x the mean: the next one on the ring.
        ({"owner": 4, "next": 0, "third": 0}, URLS, 1.25, "next"),
        ({"owner": 4, "next": 4, "third": 0}, URLS, 1.25, "third"),
        # Everyone equally loaded: the owner again (cap = ceil(1.25 * 10 / 3) = 5 > 3).
        ({"owner": 3, "next": 3, "third": 3}, URLS, 1.25, "owner"),
        # A generous factor keeps a hot key on its owner longer.
        ({"owner": 4, "next": 0, "third": 0}, URLS, 4.0, "owner"),
        # Not eligible (ejected or already tried): skipped whatever its load.
        ({}, ("next", "third"), 1.25, "next"),
        ({}, ("third",), 1.25, "third"),
        ({}, (), 1.25, None),
    ],
)
def test_bounded_load(in_flight, eligible, load_factor, expected):
    key = KEYS[0]
    idle = dict.fromkeys(URLS, 0)
    owner = prefix.choose(RING, key, idle, URLS)
    # The ring order after the owner, for this key: owner, next, third.
    order = [owner]
    for _ in range(2):
        order.append(prefix.choose(RING, key, idle, [u for u in URLS if u not in order]))
    name = dict(zip(("owner", "next", "third"), order, strict=True))
    loads = {name[n]: count for n, count in in_flight.items()}
    urls = [name[n] for n in eligible] if eligible != URLS else URLS
    got = prefix.choose(RING, key, loads, urls, load_factor)
    assert got == (name[expected] if expected else None)


@pytest.mark.parametrize(
    ("total", "eligible", "factor", "cap"),
    [(0, 2, 1.25, 1), (1, 2, 1.25, 2), (10, 2, 1.25, 7), (10, 3, 1.25, 5), (3, 1, 1.25, 5)],
)
def test_capacity(total, eligible, factor, cap):
    assert prefix.capacity(total, eligible, factor) == cap


def test_a_hot_prefix_cannot_swamp_one_backend():
    """100 requests of one prefix in flight at once spread over every backend."""
    loads = dict.fromkeys(URLS, 0)
    for _ in range(100):
        loads[prefix.choose(RING, KEYS[0], loads, URLS)] += 1
    # The owner fills to capacity (2 x the mean: 67 of 100), the next one on the ring takes the
    # rest; at 1.25 x the mean the owner and the next would stop at 42 each.
    assert sorted(loads.values()) == [0, 33, 67], loads
    assert max(loads.values()) <= prefix.capacity(99, 3, prefix.DEFAULT_LOAD_FACTOR)
    loads = dict.fromkeys(URLS, 0)
    for _ in range(100):
        loads[prefix.choose(RING, KEYS[0], loads, URLS, load_factor=1.25)] += 1
    assert sorted(loads.values()) == [16, 42, 42], loads


# ---- the pool -----------------------------------------------------------------------------------


def test_pool_with_prefix_policy_routes_by_key_and_skips_the_ejected():
    pool = BackendPool("prefill", URLS, Policy.PREFIX)
    key = prefix.prefix_key(_chat(SYSTEM_A, "hi"))
    owner = pool.pick(key=key)
    assert all(pool.pick(key=key) is owner for _ in range(5))
    pool.eject(owner, "refused")
    moved = pool.pick(key=key)
    assert moved is not owner
    assert pool.pick(exclude=[moved], key=key) not in (owner, moved)
    pool.probe_ok(owner)
    assert pool.pick(key=key) is owner  # back with its keys
    # Without a key (GET /v1/models, the decode pool): least outstanding.
    pool.begin(pool.backends[0])
    assert pool.pick() is not pool.backends[0]
