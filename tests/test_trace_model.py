"""The trace replay's pure half: slicing whole conversations, scaling, prompts whose equal
hash_ids are equal token blocks, the reuse bound, SLO attainment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.trace_model import (
    Scale,
    Slo,
    TraceRequest,
    attainment,
    conversations,
    new_tokens,
    parse_trace,
    pick_slice,
    prompt_for,
    request_tbt_ms,
    routing_regret,
)

SLICE = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "conversation_slice.jsonl"


def req(ts: int, hash_ids: list[int], input_length: int | None = None, out: int = 40):
    n = input_length if input_length is not None else 512 * len(hash_ids)
    return TraceRequest(ts, n, out, tuple(hash_ids))


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}', "needs 2"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "hash_ids"),
        ("not json", "line 1"),
    ],
)
def test_parse_trace_names_the_bad_line(line, error):
    with pytest.raises(ValueError, match=error):
        parse_trace([line])


def test_parse_trace_reads_the_published_format():
    lines = [
        '{"timestamp": 27482, "input_length": 6955, "output_length": 52, '
        '"hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}',
        "",
    ]
    (r,) = parse_trace(lines)
    assert (r.timestamp_ms, r.input_length, r.output_length, len(r.hash_ids)) == (
        27482,
        6955,
        52,
        14,
    )
    assert parse_trace([json.dumps(r.to_json())]) == [r]


def test_conversations_group_by_the_blocks_after_the_shared_head():
    trace = [
        req(0, [0, 1, 2]),
        req(1, [0, 5]),
        req(2, [0, 1, 2, 3]),
        req(3, [0]),
        req(4, [0, 5, 6]),
    ]
    assert conversations(trace) == [[0, 2], [1, 4], [3]]
    assert conversations(trace, key_blocks=1) == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize(
    ("max_requests", "max_input", "min_turns", "picked_ts"),
    [
        (10, 10_000, 2, [0, 1, 2, 4, 5, 6]),  # every conversation of 2+ turns
        (3, 10_000, 2, [0, 2, 5]),  # [1, 4, 6] would overflow 3: skipped, not cut
        (10, 1536, 2, [0, 2, 5]),  # the one with a 4-block prompt is left out whole
        (10, 10_000, 1, [0, 1, 2, 3, 4, 5, 6]),
    ],
)
def test_pick_slice_keeps_whole_conversations(max_requests, max_input, min_turns, picked_ts):
    trace = [
        req(0, [0, 1]),
        req(1, [0, 7]),
        req(2, [0, 1, 2]),
        req(3, [0, 9]),  # a conversation of one request
        req(4, [0, 7, 8]),
        req(5, [0, 1, 2]),
        req(6, [0, 7, 8, 10]),
    ]
    sliced = pick_slice(trace, max_requests, max_input, min_turns)
    assert [r.timestamp_ms for r in sliced] == picked_ts


@pytest.mark.parametrize(
    ("div", "input_length", "output_length", "block", "tokens", "out"),
    [
        (1, 1000, 300, 512, 1000, 32),
        (4, 1000, 300, 128, 250, 32),  # output capped
        (4, 1001, 2, 128, 251, 1),  # rounds up the prompt, never to an empty output
        (16, 512, 80, 32, 32, 5),
    ],
)
def test_scale(div, input_length, output_length, block, tokens, out):
    s = Scale(div, 0.5, 32)
    r = TraceRequest(2000, input_length, output_length, tuple(range(-(-input_length // 512))))
    assert (s.block_tokens, s.input_tokens(r), s.output_tokens(r)) == (block, tokens, out)
    assert s.arrival_s(r, first_ms=1000) == 0.5


@pytest.mark.parametrize("bad", [(3, 1.0, 1), (4, 0.0, 1), (4, 1.0, 0)])
def test_scale_refuses_factors_that_do_not_fit(bad):
    with pytest.raises(ValueError):
        Scale(*bad)


def test_equal_hash_ids_are_equal_token_blocks():
    s = Scale(16, 1.0, 8)  # 32-token blocks
    a = prompt_for(req(0, [0, 1, 2], input_length=1500), s, vocab=2048)
    b = prompt_for(req(0, [0, 1, 9]), s, vocab=2048)
    assert len(a) == 94  # ceil(1500 / 16): the last block partial
    assert len(b) == 96
    assert a[:64] == b[:64]
    assert a[64:] != b[64:94]
    assert all(3 <= t < 2048 for t in a)
    assert prompt_for(req(0, [0, 1, 2]), s, vocab=2048, seed=1)[:32] != a[:32]


@pytest.mark.parametrize(
    ("trace", "fresh"),
    [
        ([req(0, [0, 1]), req(1, [0, 1, 2])], [256, 128]),
        ([req(0, [0, 1]), req(1, [0, 2])], [256, 128]),
        ([req(0, [0, 1]), req(1, [0, 1])], [256, 0]),  # a resent prompt: nothing new
        # a block first seen partly (an earlier prompt ended inside it) counts what is beyond
        ([req(0, [0, 1], input_length=600), req(1, [0, 1])], [150, 106]),
        ([req(0, [5], input_length=100), req(1, [5], input_length=60)], [25, 0]),
    ],
)
def test_new_tokens_is_the_first_seen_blocks(trace, fresh):
    assert new_tokens(trace, Scale(4, 1.0, 8)) == fresh


def test_the_committed_slice_is_whole_conversations_with_reuse():
    text = SLICE.read_text()
    assert len(text.encode()) <= 300_000
    trace = parse_trace(text.splitlines())
    groups = conversations(trace)
    assert len(trace) == 100
    assert all(len(g) >= 2 for g in groups)
    s = Scale(4, 0.05, 32)
    bound = sum(new_tokens(trace, s))
    assert bound < 0.5 * sum(s.input_tokens(r) for r in trace)
    assert max(s.input_tokens(r) for r in trace) + 32 <= 4096  # the tiny model's length


@pytest.mark.parametrize(
    ("times", "q", "tbt"),
    [([0.5], 90, None), ([0.5, 0.6], 90, 100.0), ([0.0, 0.1, 0.2, 1.2], 50, 100.0)],
)
def test_request_tbt_ms(times, q, tbt):
    got = request_tbt_ms(times, q)
    assert got == pytest.approx(tbt) if tbt is not None else got is None


def test_attainment_counts_a_request_meeting_both_slos():
    samples = [
        {"ttft_ms": 100.0, "tbt_ms": 10.0},  # both
        {"ttft_ms": 100.0, "tbt_ms": None},  # one token: both
        {"ttft_ms": 900.0, "tbt_ms": 10.0},  # TBT only
        {"ttft_ms": 100.0, "tbt_ms": 90.0},  # TTFT only
        {"error": "HTTP 500"},
    ]
    got = attainment(samples, Slo(ttft_ms=500, tbt_ms=50), span_s=4.0)
    assert got == {"ttft_slo_%": 60.0, "tbt_slo_%": 60.0, "both_slo_%": 40.0, "goodput_rps": 0.5}


@pytest.mark.parametrize(
    ("hash_ids", "engines", "regret"),
    [
        # A later turn sent where its first turn went: nothing lost.
        ([[1, 2], [1, 2, 3]], ["a", "a"], [0, 0]),
        # Sent to the other engine: both blocks of its history recomputed (or pulled).
        ([[1, 2], [1, 2, 3]], ["a", "b"], [0, 1024]),
        # A new chat sent away from the shared first block loses it; its second turn, sent
        # where only that shared block is, loses the block of its history held elsewhere.
        ([[1, 2], [1, 5], [1, 2, 3]], ["a", "b", "b"], [0, 512, 512]),
        # A prompt's last block is never reused, so holding it elsewhere loses nothing.
        ([[1, 2], [1, 2]], ["a", "b"], [0, 512]),
        ([[1], [1]], ["a", "b"], [0, 0]),
        # Unknown engine: not judged, and it caches nothing anyone can be judged against.
        ([[1, 2], [1, 2, 3]], [None, "b"], [0, 0]),
    ],
)
def test_routing_regret_counts_tokens_another_engine_held(hash_ids, engines, regret):
    scale = Scale(1, 1.0, 1)
    requests = [req(i, h) for i, h in enumerate(hash_ids)]
    assert routing_regret(requests, engines, scale) == regret


def test_choices_reads_each_legs_backend_from_the_proxy_log(tmp_path):
    from benchmarks.trace import choices

    log = tmp_path / "proxy.log"
    log.write_text(
        "t INFO mooncake_vllm.proxy.legs: trace-kv-0 prefill http://127.0.0.60:1 -> 200\n"
        "t INFO mooncake_vllm.proxy.legs: trace-kv-0 decode http://127.0.0.61:2 -> 200\n"
        "t WARNING mooncake_vllm.proxy.app: trace-kv-1 sent again\n"
        "t INFO mooncake_vllm.proxy.legs: trace-kv-1 prefill http://127.0.0.60:1 -> 503\n"
        "t INFO mooncake_vllm.proxy.legs: trace-kv-1 prefill http://127.0.0.62:3 -> 200\n"
        "t INFO mooncake_vllm.proxy.legs: trace-kvx-2 prefill http://127.0.0.60:1 -> 200\n"
        "t INFO mooncake_vllm.proxy.legs: warm-kv-0 prefill http://127.0.0.60:1 -> 200\n"
    )
    names = {"http://127.0.0.60:1": "prefill0", "http://127.0.0.61:2": "decode0"}
    assert choices(log, "trace-kv-", names) == {
        0: {"prefill": "prefill0", "decode": "decode0"},
        1: {"prefill": "http://127.0.0.62:3"},  # the retried leg's backend; unnamed: its URL
    }
