"""KV events (``--kv-events``): malformed and oversized input dropped, counted, survived (no vLLM).

Before: one malformed event (an unhashable hash, string token ids, events that are not a list)
ended the subscriber's task silently and the index went stale; a 256 MiB message was taken in;
and an engine's part of the index grew without bound. A real PUB socket on 127.0.0.1 publishes
here as vLLM does, and as a broken or hostile publisher might.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from mooncake_vllm.proxy import kv_events
from mooncake_vllm.proxy.kv_events import KvEventSubscriber
from mooncake_vllm.proxy.kv_index import (
    MAX_BLOCKS_PER_ENGINE,
    BadEvent,
    BlockStored,
    KvIndex,
    decode_event,
    parse_event,
)
from mooncake_vllm.proxy.metrics import ProxyMetrics

BS = 4
P0 = "http://p0:1"
PROMPT = list(range(100, 116))  # 4 blocks
OTHER = list(range(200, 204))


def stored(tokens, hashes, parent=None, **extra):
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": BS,
        **extra,
    }


GOOD = stored(PROMPT[:4], [1])

# Events the old subscriber died on or mis-applied, and the reason each is dropped with now.
BAD_EVENTS = {
    "an unhashable hash": (stored(PROMPT[:4], [[1, [2]]]), "invalid"),
    "string token ids": (stored(["a", "b", "c", "d"], [1]), "invalid"),
    "a token id past int64": (stored([2**64 - 1, 1, 2, 3], [1]), "invalid"),
    "a negative token id": (stored([-1, 1, 2, 3], [1]), "invalid"),
    "no block size": ({k: v for k, v in GOOD.items() if k != "block_size"}, "invalid"),
    "a zero block size": ({**GOOD, "block_size": 0}, "invalid"),
    "hashes not a list": ({"type": "BlockRemoved", "block_hashes": 7}, "invalid"),
    "a parent that is a map": (stored(PROMPT[:4], [1], parent={"x": 1}), "invalid"),
    "an event that is not a map": (5, "invalid"),
    "no type": ({"block_hashes": [1]}, "invalid"),
    "a type from a newer vLLM": ({"type": "BlockPinned", "block_hashes": [1]}, "unknown_type"),
}


@pytest.mark.parametrize(("event", "reason"), BAD_EVENTS.values(), ids=BAD_EVENTS.keys())
def test_a_malformed_event_is_a_bad_event_and_changes_nothing(event, reason):
    index = KvIndex()
    index.apply(P0, GOOD)
    with pytest.raises(BadEvent) as exc:
        decode_event(msgspec.msgpack.encode(event))
    assert exc.value.reason == reason
    if isinstance(event, dict):
        with pytest.raises(BadEvent, match=reason):
            parse_event(event)
        with pytest.raises(BadEvent):
            index.apply(P0, event)
    assert index.matched_tokens(PROMPT, [P0]) == {P0: 4}


def test_vllms_fields_we_do_not_use_are_ignored():
    event = decode_event(msgspec.msgpack.encode(stored(PROMPT[:4], [b"h" * 32], medium="GPU")))
    assert event == BlockStored(
        block_hashes=[b"h" * 32], token_ids=PROMPT[:4], block_size=BS, parent_block_hash=None
    )


def test_each_engines_part_is_bounded_oldest_first():
    assert KvIndex().max_blocks_per_engine == MAX_BLOCKS_PER_ENGINE == 1 << 20
    index = KvIndex(max_blocks_per_engine=3)
    index.apply(P0, stored(PROMPT, [1, 2, 3, 4]))
    cache = index.engines[P0]
    assert (len(cache.key_of), len(cache.held), cache.evicted_blocks) == (3, 3, 1)
    assert index.matched_tokens(PROMPT, [P0]) == {P0: 0}  # the first block forgotten first
    index.apply(P0, stored(PROMPT[:4], [1]))  # stored again: the oldest (2) goes
    index.apply(P0, stored(PROMPT[4:8], [2], parent=1))  # and 3, the oldest then
    assert list(cache.key_of) == [4, 1, 2] and cache.evicted_blocks == 3
    assert index.matched_tokens(PROMPT, [P0]) == {P0: 8}
    index.apply(P0, stored(PROMPT[:4], [1]))  # a hit reported again: now the newest
    index.apply(P0, stored(PROMPT[8:12], [3], parent=2))
    assert list(cache.key_of) == [2, 1, 3] and cache.evicted_blocks == 4
    # Many engines' worth of blocks in one engine's stream: still within the bound.
    index.apply(P0, stored(list(range(4000)), range(10, 1010)))
    assert (len(cache.key_of), len(cache.held)) == (3, 3)
    with pytest.raises(ValueError, match="max_blocks_per_engine=0"):
        KvIndex(max_blocks_per_engine=0)


async def _until(what, deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.01)


def _dropped(metrics: ProxyMetrics, reason: str) -> float | None:
    labels = {"backend": P0, "reason": reason}
    return metrics.registry.get_sample_value("mooncake_proxy_kv_events_dropped_total", labels)


async def test_malformed_and_oversized_messages_leave_the_subscriber_running():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index, metrics = KvIndex(), ProxyMetrics()
    endpoints = {P0: f"tcp://127.0.0.1:{port}"}
    sub = KvEventSubscriber(index, endpoints, metrics, restart_delay_s=0.01)
    stream = sub.streams[P0]
    seq = 0

    def send(*events, frames=None, payload=None) -> None:
        nonlocal seq
        if payload is None:
            payload = msgspec.msgpack.encode([0.0, list(events), None])
        pub.send_multipart(frames or [b"", seq.to_bytes(8, "big"), payload])
        seq += 1

    async def send_until_heard(prompt) -> None:
        for _ in range(2000):  # a SUB (re)joins late: publish until it hears
            send(stored(prompt[:4], [seq + 1000]))
            await asyncio.sleep(0.01)
            if index.matched_tokens(prompt, [P0])[P0]:
                return
        raise AssertionError("the subscriber never heard the good event")

    sub.start()
    try:
        await send_until_heard(PROMPT)
        # Unreadable messages: each dropped whole.
        send(frames=[b"two", b"frames"])
        send(frames=[b"", b"\x01", msgspec.msgpack.encode([0.0, [], None])])  # a 1-byte seq
        send(payload=b"\xc1 not msgpack")
        send(payload=msgspec.msgpack.encode([0.0]))  # a batch of the wrong arity
        send(payload=msgspec.msgpack.encode([0.0, 5, None]))  # events not a list
        # Bad events in one batch: each dropped (what it meant is lost: the engine's part is
        # cleared), the good ones after them applied.
        bad = [event for event, _ in BAD_EVENTS.values()]
        send(stored(OTHER, [9]), *bad, stored(PROMPT[:4], [1]), stored(PROMPT[4:8], [2], parent=1))
        expected = {"unreadable": 5, "invalid": len(bad) - 1, "unknown_type": 1}
        await _until(lambda: stream.dropped == expected)
        assert index.matched_tokens(PROMPT, [P0]) == {P0: 8}
        assert index.matched_tokens(OTHER, [P0]) == {P0: 0}  # before a bad one: forgotten
        assert {r: _dropped(metrics, r) for r in expected} == expected
        assert _dropped(metrics, "failed") == _dropped(metrics, "disconnected") == 0

        # Over MAX_MESSAGE_BYTES: never read (ZMQ drops the connection for good), so its
        # block never lands; the subscriber subscribes again and hears what follows.
        other = list(range(500, 504))
        filler = b"x" * (kv_events.MAX_MESSAGE_BYTES + 1024)
        send(stored(other, [77], filler=filler))
        await send_until_heard(list(range(300, 316)))
        assert index.matched_tokens(other, [P0]) == {P0: 0}
        assert index.matched_tokens(PROMPT, [P0]) == {P0: 0}  # cleared: events were lost
        assert stream.restarts == 1 and stream.dropped["disconnected"] == 1
        assert _dropped(metrics, "disconnected") == 1
        assert not sub._tasks[P0].done()
    finally:
        await sub.stop()
        pub.close(linger=0)
        ctx.term()


async def test_a_subscription_that_ends_is_logged_and_started_again(caplog):
    index = KvIndex()
    index.apply(P0, GOOD)
    sub = KvEventSubscriber(index, {P0: "tcp://no such endpoint"}, restart_delay_s=0.01)
    sub.start()
    try:
        await _until(lambda: sub.streams[P0].restarts >= 2)
        assert not sub._tasks[P0].done()
        assert "the subscription to tcp://no such endpoint ended" in caplog.text
        assert "ZMQError" in caplog.text  # with its traceback
        assert index.matched_tokens(PROMPT, [P0]) == {P0: 0}
    finally:
        await sub.stop()
