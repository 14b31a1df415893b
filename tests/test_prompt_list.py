"""Splitting a list of prompts and merging the answers as vLLM answers the list: pure, table-driven.

The expected shapes are vLLM 0.32's (``OpenAIServingCompletion``): non-streamed choices numbered
in prompt order, streamed choice ``i`` of prompt ``p`` numbered ``p * n + i``, usage summed.
"""

from __future__ import annotations

import json

import pytest

from mooncake_vllm.proxy import prompt_list


@pytest.mark.parametrize(
    ("prompt", "split"),
    [
        ("text", None),
        ([1, 2, 3], None),  # one prompt of token ids
        (["one"], None),  # a list of one prompt goes through unchanged
        ([[1, 2]], None),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (["a", "a", "b"], ["a", "a", "b"]),
    ],
)
def test_only_lists_of_several_prompts_are_split(prompt, split):
    assert prompt_list.prompts_to_split({"prompt": prompt}) == split


@pytest.mark.parametrize(
    ("prompts", "distinct", "leg_of"),
    [
        (["a", "b"], ["a", "b"], [0, 1]),
        (["a", "b", "a"], ["a", "b"], [0, 1, 0]),
        ([[1, 2], [1, 2], [3]], [[1, 2], [3]], [0, 0, 1]),
        (["x", "x", "x"], ["x"], [0, 0, 0]),
    ],
)
def test_one_prefill_leg_per_distinct_prompt(prompts, distinct, leg_of):
    plan = prompt_list.plan(prompts)
    assert (plan.distinct, plan.leg_of) == (distinct, leg_of)


def test_each_prompt_gets_the_whole_request():
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 7}
    assert prompt_list.body_for(body, "b") == {"model": "m", "prompt": "b", "n": 2, "seed": 7}
    assert body["prompt"] == ["a", "b"]


def _answer(texts, prompt_tokens, completion_tokens, **extra):
    return {
        "id": "cmpl-r",
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [
            {"index": i, "text": t, "finish_reason": "length"} for i, t in enumerate(texts)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        **extra,
    }


@pytest.mark.parametrize(
    ("answers", "texts", "usage"),
    [
        (  # n = 1
            [_answer(["A"], 3, 5), _answer(["B"], 4, 5)],
            ["A", "B"],
            {"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17},
        ),
        (  # n = 2: prompt 0's choices are 0 and 1, prompt 1's are 2 and 3
            [_answer(["A0", "A1"], 3, 8), _answer(["B0", "B1"], 4, 6), _answer(["C0", "C1"], 1, 2)],
            ["A0", "A1", "B0", "B1", "C0", "C1"],
            {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
        ),
    ],
)
def test_answers_merge_in_prompt_order_with_usage_summed(answers, texts, usage):
    merged = prompt_list.merge_answers(answers)
    assert [c["text"] for c in merged["choices"]] == texts
    assert [c["index"] for c in merged["choices"]] == list(range(len(texts)))
    assert merged["usage"] == usage
    assert (merged["id"], merged["created"], merged["model"]) == ("cmpl-r", 100, "m")
    assert answers[1]["choices"][0]["index"] == 0  # the answers are not changed


def test_merged_usage_keeps_every_field_vllm_sends():
    answers = [_answer(["A"], 3, 1), _answer(["B"], 4, 2)]
    for answer in answers:
        answer["usage"] |= {"prompt_tokens_details": None, "completion_tokens_details": None}
    assert prompt_list.merge_answers(answers)["usage"] == {
        "prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
        "prompt_tokens_details": None, "completion_tokens_details": None,
    }  # fmt: skip


def test_merged_answer_takes_the_last_prompts_cached_tokens_and_drops_per_request_metrics():
    first = _answer(["A"], 3, 1, metrics={"ttft": 1})
    first["usage"]["prompt_tokens_details"] = {"cached_tokens": 0}
    last = _answer(["B"], 3, 1, metrics={"ttft": 2})
    last["usage"]["prompt_tokens_details"] = {"cached_tokens": 2}
    merged = prompt_list.merge_answers([first, last])
    assert merged["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert merged["metrics"] is None


# ---- streams ------------------------------------------------------------------------------------


def _event(message) -> bytes:
    return b"data: " + json.dumps(message).encode() + b"\n\n"


def _chunk(index, text, created=100):
    return {"id": "cmpl-r", "object": "text_completion", "created": created, "model": "m",
            "choices": [{"index": index, "text": text, "finish_reason": None}]}  # fmt: skip


def _usage(prompt_tokens, completion_tokens, created=100):
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
    return {"id": "cmpl-r", "object": "text_completion", "created": created, "model": "m",
            "choices": [], "usage": usage}  # fmt: skip


def _events(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize(
    ("n", "feeds", "indexes"),
    [
        (1, [(0, _chunk(0, "a")), (1, _chunk(0, "b")), (0, _chunk(0, "c"))], [0, 1, 0]),
        (2, [(1, _chunk(1, "b1")), (0, _chunk(0, "a0")), (2, _chunk(0, "c0"))], [3, 0, 4]),
        (3, [(2, _chunk(2, "x"))], [8]),
    ],
)
def test_stream_choices_are_renumbered_prompt_times_n_plus_choice(n, feeds, indexes):
    merge = prompt_list.StreamMerge(prompts=3, choices_per_prompt=n)
    out = b"".join(merge.feed(p, _event(m)) for p, m in feeds)
    assert [e["choices"][0]["index"] for e in _events(out)] == indexes


def test_stream_takes_the_id_and_created_of_the_first_event():
    merge = prompt_list.StreamMerge(2, 1)
    out = merge.feed(1, _event(_chunk(0, "b", created=101)))
    out += merge.feed(0, _event(_chunk(0, "a", created=102)))
    assert [e["created"] for e in _events(out)] == [101, 101]


def test_stream_usage_chunks_are_summed_into_one_before_a_single_done():
    merge = prompt_list.StreamMerge(2, 2)
    out = b""
    for prompt, tokens in ((0, 3), (1, 4)):
        out += merge.feed(prompt, _event(_chunk(0, "x")))
        out += merge.feed(prompt, _event(_usage(tokens, 10)) + b"data: [DONE]\n\n")
    assert [e == "[DONE]" or "usage" in e for e in _events(out)] == [False, False]
    events = _events(out + merge.finish())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert events[-2]["choices"] == []
    assert events[-2]["usage"] == {"prompt_tokens": 7, "completion_tokens": 20, "total_tokens": 27}


def test_stream_without_usage_ends_with_done_only():
    merge = prompt_list.StreamMerge(2, 1)
    merge.feed(0, _event(_chunk(0, "a")) + b"data: [DONE]\n\n")
    merge.feed(1, b"data: [DONE]\n\n")
    assert merge.finish() == b"data: [DONE]\n\n"


@pytest.mark.parametrize("cut", [1, 7, 20, 40])
def test_an_event_split_across_chunks_is_sent_whole(cut):
    raw = _event(_chunk(0, "hello")) + _event(_chunk(0, "world"))
    merge = prompt_list.StreamMerge(2, 1)
    first = merge.feed(1, raw[:cut])
    assert first == b"" or first.endswith(b"\n\n")
    out = first + merge.feed(1, raw[cut:])
    assert [e["choices"][0]["text"] for e in _events(out)] == ["hello", "world"]
    assert all(e["choices"][0]["index"] == 1 for e in _events(out))


def test_an_error_event_is_passed_on_and_ends_the_stream():
    merge = prompt_list.StreamMerge(2, 1)
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    out = merge.feed(0, _event(_chunk(0, "a")))
    out += merge.feed(1, _event(error))
    assert merge.failed
    out += merge.feed(0, _event(_chunk(0, "late")))
    events = _events(out + merge.finish())
    assert events == [_events(_event(_chunk(0, "a")))[0], error, "[DONE]"]


def test_comments_pass_unchanged():
    merge = prompt_list.StreamMerge(1, 1)
    assert merge.feed(0, b": keep-alive\n\n") == b": keep-alive\n\n"
