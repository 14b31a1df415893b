"""Every request parameter of vLLM's OpenAI completions and chat APIs, through the pair and on a
plain vLLM: the same answer.

The parameters are the fields of vLLM 0.32's own request models (``CompletionRequest`` and
``ChatCompletionRequest``, ``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``);
``test_every_request_field_has_a_case`` fails when vLLM grows a field that no case here covers.
Each case sends one request to the shared cluster's plain vLLM and the same request to the
proxy in front of its prefill/decode pair, streamed and not, and compares what a client sees:

- text and token ids exactly (greedy, and seeded sampling at temperature 0.8), ``usage``
  exactly, finish and stop reasons, the choices and their ``index`` in order;
- log-probabilities within ``LOGPROB_TOLERANCE``: the decode computes the last prompt token's
  logits over transferred KV, plain over its own in one pass, so float rounding differs;
- where plain answers with an error, the proxy answers with the same status and error type.

And per case, the pair's counters: the decode's ``mooncake_vllm:pulls_total`` grows by the
number of distinct prompts (``Case.pulls``; 0 for requests the decode serves alone and for
errors), and no pull fails (the ``pd`` fixture). Prompts are unique per case and mode, so no
prefix cache blurs the count.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness import servers
from harness.pd import eventually
from harness.xpyd import start_pair_proxy

pytestmark = pytest.mark.servers
# Answers are compared, never timed: the next module's servers start beside these tests.
SHARES_THE_MACHINE = True

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MODES = ("non-stream", "stream")
# Largest difference allowed between plain's and the pair's log-probabilities (nats). Measured:
# see the README's parameter table.
LOGPROB_TOLERANCE = 1e-3
MAX_TOKENS = 8

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
        },
    },
}
SEEDED = {"temperature": 0.8, "seed": 1234}

# ---- the cases ----------------------------------------------------------------------------------

Extra = dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    """One request shape. ``extra`` is added to a greedy request of ``MAX_TOKENS`` tokens; a
    callable gets plain's greedy answer to the same prompt first (to pick tokens it produced).
    ``prompts``: ``text`` (one unique string), ``ids`` (one list of token ids), or a list kind
    of ``PROMPT_LISTS``."""

    id: str
    covers: tuple[str, ...]
    extra: Extra = field(default_factory=dict)
    path: str = COMPLETIONS
    modes: tuple[str, ...] = MODES
    prompts: str = "text"
    alone: bool = False  # the decode serves it alone: no transfer expected

    @property
    def chat(self) -> bool:
        return self.path == CHAT


def _first_token(ref: dict[str, Any]) -> int:
    return ref["choices"][0]["token_ids"][0]


def _word(ref: dict[str, Any]) -> str:
    words = ref["choices"][0]["text"].split()
    return words[len(words) // 2] if words else "the"


COMPLETION_CASES = [
    Case("greedy", ("model", "prompt", "max_tokens", "temperature", "stream", "user")),
    Case("token-ids", ("prompt",), prompts="ids"),
    Case("seeded", ("seed", "top_p", "top_k", "min_p"),
         {**SEEDED, "top_p": 0.95, "top_k": 50, "min_p": 0.01}),
    Case("n2-seeded", ("n",), {**SEEDED, "n": 2}),
    Case("n3-seeded", ("n",), {**SEEDED, "n": 3}),
    Case("n2-greedy", ("n",), {"n": 2}),  # refused by vLLM: n > 1 needs sampling
    Case("penalties", ("frequency_penalty", "presence_penalty", "repetition_penalty"),
         {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.3}),
    Case("logprobs", ("logprobs",), {"logprobs": 3}),
    Case("logprobs-seeded-n2", ("logprobs", "n"), {**SEEDED, "n": 2, "logprobs": 2}),
    Case("logprob-token-ids", ("logprob_token_ids",), {"logprobs": 1, "logprob_token_ids": [5, 9]}),
    Case("tokens-as-ids", ("return_tokens_as_token_ids",),
         {"logprobs": 2, "return_tokens_as_token_ids": True}),
    Case("echo", ("echo",), {"echo": True}),
    Case("echo-max-tokens-0", ("echo",), {"echo": True, "max_tokens": 0}),
    Case("echo-logprobs", ("echo", "logprobs"), {"echo": True, "logprobs": 2}, alone=True),
    Case("prompt-logprobs", ("prompt_logprobs",), {"prompt_logprobs": 2}, alone=True),
    Case("min-tokens", ("min_tokens", "stop_token_ids"),
         lambda ref: {"min_tokens": 6, "stop_token_ids": [_first_token(ref)]}),
    Case("min-tokens-over-max", ("min_tokens",), {"min_tokens": 20}),  # refused by vLLM
    Case("stop-string", ("stop", "include_stop_str_in_output"),
         lambda ref: {"stop": [_word(ref)], "include_stop_str_in_output": True}),
    Case("stop-token-ids", ("stop_token_ids",),
         lambda ref: {"stop_token_ids": [ref["choices"][0]["token_ids"][2]]}),
    Case("ignore-eos", ("ignore_eos",), {"ignore_eos": True}),
    Case("special-tokens", ("skip_special_tokens", "spaces_between_special_tokens"),
         {"skip_special_tokens": False, "spaces_between_special_tokens": False}),
    Case("logit-bias", ("logit_bias",), lambda ref: {"logit_bias": {str(_first_token(ref)): -100}}),
    Case("allowed-token-ids", ("allowed_token_ids",), {"allowed_token_ids": [11, 12, 13, 14]}),
    Case("bad-words", ("bad_words",), lambda ref: {"bad_words": [_word(ref)]}),
    Case("usage-in-stream", ("stream_options",),
         {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         modes=("stream",)),
    Case("stream-options-no-stream", ("stream_options",),
         {"stream_options": {"include_usage": True}}, modes=("non-stream",)),  # refused by vLLM
    Case("stream-interval", ("stream_interval",), {"stream_interval": 3}),
    Case("json-object", ("response_format",), {"response_format": {"type": "json_object"}}),
    Case("json-schema", ("response_format",), {"response_format": JSON_SCHEMA}),
    Case("choice", ("structured_outputs",), {"structured_outputs": {"choice": ["yes", "no"]}}),
    Case("regex", ("structured_outputs",), {"structured_outputs": {"regex": "[a-z]{2,5}"}}),
    Case("beam-search", ("use_beam_search", "length_penalty"),
         {"use_beam_search": True, "n": 2, "length_penalty": 0.8}, alone=True),
    Case("truncate-left", ("truncate_prompt_tokens", "truncation_side"),
         {"truncate_prompt_tokens": 12, "truncation_side": "left"}),
    Case("truncate-right", ("truncate_prompt_tokens", "truncation_side"),
         {"truncate_prompt_tokens": 12, "truncation_side": "right"}),
    Case("no-special-tokens", ("add_special_tokens",), {"add_special_tokens": False}),
    Case("suffix", ("suffix",), {"suffix": " and the end"}),
    Case("prompt-embeds", ("prompt_embeds",), {"prompt_embeds": "AAAA"}, alone=True),
    Case("priority", ("priority",), {"priority": 1}),
    Case("cache-salt", ("cache_salt",), {"cache_salt": "a-salt-of-this-test"}),
    Case("request-id", ("request_id",), {"request_id": "matrix-{mode}"}),
    Case("session-id", ("session_id",), {"session_id": "matrix-session"}),
    Case("watermarking", ("watermarking",), {"watermarking": True}),
    Case("repetition-detection", ("repetition_detection",),
         {"repetition_detection": {"max_pattern_size": 3, "min_count": 2}, "ignore_eos": True}),
    Case("thinking-budget", ("thinking_token_budget",), {"thinking_token_budget": 4}),
    Case("vllm-xargs", ("vllm_xargs",), {"vllm_xargs": {"matrix": 1}}),
    Case("client-handoff", ("kv_transfer_params",),
         {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "forged"}}),
    Case("ec-transfer-params", ("ec_transfer_params",), {"ec_transfer_params": {"k": "v"}}),
    Case("render-only", ("mm_payload", "return_mm_kwargs", "return_token_offsets",
                         "routed_experts_prompt_start"),
         {"mm_payload": "none", "return_token_offsets": True, "routed_experts_prompt_start": 0}),
    Case("return-mm-kwargs", ("return_mm_kwargs",), {"return_mm_kwargs": False}),
    Case("too-many-tokens", ("max_tokens",), {"max_tokens": 50_000}),  # refused by vLLM
    Case("unknown-model", ("model",), {"model": "no-such-model"}),  # refused by vLLM
    Case("return-token-ids-off", ("return_token_ids",), {"return_token_ids": False}),
    # Not a field of vLLM 0.32's CompletionRequest: ignored like any unknown field.
    Case("best-of", (), {**SEEDED, "best_of": 3}),
    # Lists of prompts: a prefill leg per distinct prompt, a decode request per prompt.
    Case("list-strings", ("prompt",), prompts="strings3"),
    Case("list-token-ids", ("prompt",), prompts="ids3"),
    Case("list-strings-n2", ("prompt", "n"), {**SEEDED, "n": 2}, prompts="strings3"),
    Case("list-ids-n2", ("prompt", "n"), {**SEEDED, "n": 2}, prompts="ids3"),
    Case("list-repeated", ("prompt",), prompts="repeated"),
    Case("list-of-one", ("prompt",), prompts="one"),
    Case("list-usage", ("prompt", "stream_options"),
         {**SEEDED, "n": 2,
          "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         prompts="strings3", modes=("stream",)),
    Case("list-echo-logprobs", ("prompt", "echo", "logprobs"),
         {"echo": True, "logprobs": 1}, prompts="strings3", alone=True),
    Case("list-logprobs", ("prompt", "logprobs"), {"logprobs": 2}, prompts="strings3"),
    Case("list-one-too-long", ("prompt",), prompts="one-too-long"),  # refused by vLLM
]  # fmt: skip

CHAT_CASES = [
    Case("chat-greedy", ("messages", "model", "max_completion_tokens", "temperature", "stream",
                         "user"), path=CHAT),
    Case("chat-max-tokens", ("max_tokens",), {"max_tokens": 5}, path=CHAT),
    Case("chat-seeded-n2", ("seed", "n", "top_p", "top_k", "min_p"),
         {**SEEDED, "n": 2, "top_p": 0.95, "top_k": 50, "min_p": 0.01}, path=CHAT),
    Case("chat-penalties", ("frequency_penalty", "presence_penalty", "repetition_penalty"),
         {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.3},
         path=CHAT),
    Case("chat-logprobs", ("logprobs", "top_logprobs"), {"logprobs": True, "top_logprobs": 3},
         path=CHAT),
    Case("chat-logprob-token-ids", ("logprob_token_ids", "return_tokens_as_token_ids"),
         {"logprobs": True, "logprob_token_ids": [5, 9], "return_tokens_as_token_ids": True},
         path=CHAT),
    Case("chat-echo", ("echo",), {"echo": True}, path=CHAT, alone=True),
    Case("chat-prompt-logprobs", ("prompt_logprobs",), {"prompt_logprobs": 1}, path=CHAT,
         alone=True),
    Case("chat-min-tokens", ("min_tokens", "stop_token_ids", "ignore_eos"),
         {"min_tokens": 4, "stop_token_ids": [7], "ignore_eos": False}, path=CHAT),
    Case("chat-stop", ("stop", "include_stop_str_in_output"),
         {"stop": ["the"], "include_stop_str_in_output": True}, path=CHAT),
    Case("chat-logit-bias", ("logit_bias", "allowed_token_ids", "bad_words"),
         {"logit_bias": {"11": 5.0}, "allowed_token_ids": [11, 12, 13, 14, 15],
          "bad_words": ["the"]}, path=CHAT),
    Case("chat-special-tokens", ("skip_special_tokens", "spaces_between_special_tokens"),
         {"skip_special_tokens": False, "spaces_between_special_tokens": False}, path=CHAT),
    Case("chat-usage", ("stream_options",),
         {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         path=CHAT, modes=("stream",)),
    Case("chat-stream-interval", ("stream_interval",), {"stream_interval": 3}, path=CHAT),
    Case("chat-json-schema", ("response_format",), {"response_format": JSON_SCHEMA}, path=CHAT),
    Case("chat-choice", ("structured_outputs",), {"structured_outputs": {"choice": ["a", "b"]}},
         path=CHAT),
    Case("chat-tools-none", ("tools", "tool_choice"), {"tools": TOOLS, "tool_choice": "none"},
         path=CHAT),
    # Needs --enable-auto-tool-choice and a --tool-call-parser, which these servers do not have:
    # plain refuses it, and so must the pair.
    Case("chat-tools-auto", ("tools", "tool_choice"), {"tools": TOOLS, "tool_choice": "auto"},
         path=CHAT),
    Case("chat-tools-required", ("tools", "tool_choice", "parallel_tool_calls"),
         {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, path=CHAT),
    Case("chat-tools-named", ("tools", "tool_choice"),
         {"tools": TOOLS, "tool_choice": {"type": "function",
                                          "function": {"name": "get_weather"}}}, path=CHAT),
    Case("chat-continue", ("add_generation_prompt", "continue_final_message"),
         {"add_generation_prompt": False, "continue_final_message": True}, path=CHAT),
    Case("chat-template", ("chat_template",),
         {"chat_template": "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n"
                           "{% endfor %}answer:"}, path=CHAT),
    Case("chat-template-kwargs", ("chat_template_kwargs", "documents"),
         {"chat_template_kwargs": {"greeting": "answer:"},
          "documents": [{"title": "t", "text": "a document"}]}, path=CHAT),
    Case("chat-reasoning", ("reasoning_effort", "include_reasoning"),
         {"reasoning_effort": "low", "include_reasoning": False}, path=CHAT),
    Case("chat-thinking-budget", ("thinking_token_budget",), {"thinking_token_budget": 4},
         path=CHAT),
    Case("chat-prompt-text", ("return_prompt_text", "return_token_ids"),
         {"return_prompt_text": True}, path=CHAT),
    Case("chat-multimodal-kwargs", ("media_io_kwargs", "mm_processor_kwargs"),
         {"media_io_kwargs": {}, "mm_processor_kwargs": {}}, path=CHAT),
    Case("chat-beam-search", ("use_beam_search", "length_penalty"),
         {"use_beam_search": True, "n": 2, "length_penalty": 0.8}, path=CHAT, alone=True),
    Case("chat-truncate", ("truncate_prompt_tokens", "truncation_side", "add_special_tokens"),
         {"truncate_prompt_tokens": 12, "truncation_side": "left", "add_special_tokens": True},
         path=CHAT),
    Case("chat-misc", ("priority", "cache_salt", "request_id", "session_id", "watermarking",
                       "vllm_xargs", "repetition_detection", "kv_transfer_params",
                       "ec_transfer_params", "mm_payload", "return_mm_kwargs",
                       "return_token_offsets", "routed_experts_prompt_start"),
         {"cache_salt": "chat-salt", "request_id": "chat-{mode}", "session_id": "s",
          "watermarking": True, "vllm_xargs": {"x": 1},
          "repetition_detection": {"max_pattern_size": 2, "min_count": 3},
          "kv_transfer_params": {"transfer_id": "forged"}, "mm_payload": "none",
          "return_token_offsets": True, "routed_experts_prompt_start": 0}, path=CHAT),
    Case("chat-priority", ("priority",), {"priority": 1}, path=CHAT),  # refused by vLLM
]  # fmt: skip

CASES = COMPLETION_CASES + CHAT_CASES


def test_every_request_field_has_a_case():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for model, cases in (
        (CompletionRequest, COMPLETION_CASES),
        (ChatCompletionRequest, CHAT_CASES),
    ):
        covered = {name for case in cases for name in case.covers}
        assert set(model.model_fields) - covered == set(), model.__name__
        assert covered - set(model.model_fields) == set(), model.__name__


# ---- prompts, unique per case and mode ----------------------------------------------------------

_WORDS = ("the cache of a block moves from prefill to decode over the transfer engine while "
          "a quick brown fox jumps over the lazy dog in the evening light").split()  # fmt: skip


def _rng(case: Case, mode: str, i: int = 0) -> random.Random:
    return random.Random(hashlib.sha256(f"{case.id}/{mode}/{i}".encode()).digest())


def _text(case: Case, mode: str, i: int = 0, words: int = 24) -> str:
    rng = _rng(case, mode, i)
    return f"{case.id} {mode} {i}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def _ids(case: Case, mode: str, i: int = 0, length: int = 30) -> list[int]:
    rng = _rng(case, mode, i)
    return [rng.randrange(3, 2048) for _ in range(length)]


def _prompts(case: Case, mode: str) -> tuple[Any, int]:
    """The prompt field and how many distinct prompts it holds."""
    kind = case.prompts
    if kind == "text":
        return _text(case, mode), 1
    if kind == "ids":
        return _ids(case, mode), 1
    if kind == "strings3":
        return [_text(case, mode, i, 10 + 7 * i) for i in range(3)], 3
    if kind == "ids3":
        return [_ids(case, mode, i, 8 + 9 * i) for i in range(3)], 3
    if kind == "repeated":
        a, b = _text(case, mode, 0), _text(case, mode, 1)
        return [a, b, a], 2
    if kind == "one":
        return [_text(case, mode)], 1
    if kind == "one-too-long":
        # Two prompts; vLLM refuses the list, and the first may have pulled before that.
        return [_text(case, mode, 0), _text(case, mode, 1, words=3000)], 2
    raise ValueError(kind)


def _body(case: Case, mode: str, model: str, prompt: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "temperature": 0, "return_token_ids": True}
    if case.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = MAX_TOKENS
    else:
        body["prompt"] = prompt
        body["max_tokens"] = MAX_TOKENS
    if mode == "stream":
        body["stream"] = True
    return body


def _formatted(extra: dict[str, Any], mode: str) -> dict[str, Any]:
    return {k: v.replace("{mode}", mode) if isinstance(v, str) else v for k, v in extra.items()}


# ---- what a client sees -------------------------------------------------------------------------


@dataclass
class Seen:
    status: int
    body: Any  # the JSON answer, or the merged view of a stream (``_stream_view``)


async def _send(http, url: str, path: str, body: dict[str, Any]) -> Seen:
    async with http.post(url + path, json=body) as resp:
        if resp.status != 200 or not body.get("stream"):
            return Seen(resp.status, await resp.json(content_type=None))
        events = []
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                payload = line[5:].strip()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return Seen(resp.status, _stream_view(events, chat=path == CHAT))


def _stream_view(events: list[Any], chat: bool) -> dict[str, Any]:
    """A stream as one answer: per choice index, its deltas joined in order."""
    choices: dict[int, dict[str, Any]] = {}
    view: dict[str, Any] = {"done": events.count("[DONE]"), "usage": None, "errors": []}
    ids = {e.get("id") for e in events if isinstance(e, dict) and "id" in e}
    view["ids"] = len(ids)
    for event in events:
        if event == "[DONE]":
            continue
        if "error" in event:
            view["errors"].append(event["error"].get("type"))
            continue
        if event.get("choices") == [] and event.get("usage"):
            view["usage"] = event["usage"]
            continue
        for c in event.get("choices", []):
            acc = choices.setdefault(c["index"], {"deltas": 0})
            acc["deltas"] += 1
            for key in ("finish_reason", "stop_reason"):
                if c.get(key) is not None:
                    acc[key] = c[key]
            if c.get("prompt_token_ids") is not None:
                acc["prompt_token_ids"] = c["prompt_token_ids"]
            acc.setdefault("token_ids", []).extend(c.get("token_ids") or [])
            if event.get("usage"):
                acc["last_usage"] = event["usage"]
            if chat:
                _join_chat_delta(acc, c)
            else:
                acc["text"] = acc.get("text", "") + (c.get("text") or "")
                if c.get("logprobs"):
                    lp = acc.setdefault("logprobs", {})
                    for key, value in c["logprobs"].items():
                        lp.setdefault(key, []).extend(value or [])
    for acc in choices.values():
        del acc["deltas"]  # how tokens are grouped into events is up to each server
    view["choices"] = [choices[i] for i in sorted(choices)]
    view["indexes"] = sorted(choices)
    return view


def _join_chat_delta(acc: dict[str, Any], choice: dict[str, Any]) -> None:
    delta = choice.get("delta") or {}
    for key in ("role",):
        if delta.get(key):
            acc[key] = delta[key]
    for key in ("content", "reasoning"):
        if delta.get(key):
            acc[key] = acc.get(key, "") + delta[key]
    for call in delta.get("tool_calls") or []:
        calls = acc.setdefault("tool_calls", {})
        fn = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
        function = call.get("function") or {}
        fn["name"] += function.get("name") or ""
        fn["arguments"] += function.get("arguments") or ""
    if choice.get("logprobs"):
        acc.setdefault("logprobs", []).extend(choice["logprobs"].get("content") or [])


# Per answer, what two servers legitimately differ in: ids made up per request and the time.
_VOLATILE = {"id", "created", "system_fingerprint", "kv_transfer_params"}


def _comparable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


def _assert_close(plain: Any, pair: Any, where: str = "") -> float:
    """Equal, but floats within LOGPROB_TOLERANCE; returns the largest float difference."""
    if isinstance(plain, float) or isinstance(pair, float):
        assert isinstance(plain, (int, float)) and isinstance(pair, (int, float)), where
        if math.isinf(plain) or math.isinf(pair):
            assert plain == pair, where
            return 0.0
        diff = abs(plain - pair)
        assert diff <= LOGPROB_TOLERANCE, f"{where}: plain {plain}, pair {pair}"
        return diff
    if isinstance(plain, dict) and isinstance(pair, dict):
        assert plain.keys() == pair.keys(), f"{where}: keys {sorted(plain)} != {sorted(pair)}"
        return max([_assert_close(plain[k], pair[k], f"{where}.{k}") for k in plain] or [0.0])
    if isinstance(plain, list) and isinstance(pair, list):
        assert len(plain) == len(pair), f"{where}: {len(plain)} != {len(pair)} items"
        pairs = enumerate(zip(plain, pair, strict=True))
        return max([_assert_close(a, b, f"{where}[{i}]") for i, (a, b) in pairs] or [0.0])
    assert plain == pair, f"{where}: plain {plain!r}, pair {pair!r}"
    return 0.0


LARGEST_LOGPROB_DIFF: list[float] = [0.0]
# (case, mode, plain's status, the pair's status, pulls, plain's error): printed after the matrix.
OUTCOMES: list[tuple[str, str, int, int, int, str]] = []


def _assert_same_answer(plain: Seen, pair: Seen) -> None:
    if plain.status != 200:
        assert pair.status == plain.status, f"plain {plain.body}, pair {pair.body}"
        assert pair.body["error"]["type"] == plain.body["error"]["type"], (plain.body, pair.body)
        return
    plain_errors = plain.body.get("errors") if isinstance(plain.body, dict) else None
    if plain_errors and pair.status != 200:
        # vLLM refuses some requests only once their stream has begun (200, then an error
        # event); the pair's prefill leg, not streamed, gets the same refusal as a 4xx.
        assert 400 <= pair.status < 500 and [pair.body["error"]["type"]] == plain_errors
        return
    assert pair.status == 200, pair.body
    diff = _assert_close(_comparable(plain.body), _comparable(pair.body), "answer")
    LARGEST_LOGPROB_DIFF[0] = max(LARGEST_LOGPROB_DIFF[0], diff)


# ---- the proxy ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy(cluster):
    with servers.running(start_pair_proxy(cluster.prefill.url, cluster.decode.url)) as proxy:
        yield proxy.url


def _pulls(pd) -> float:
    return pd.decode.metric("mooncake_vllm:pulls_total")


# ---- the matrix ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
async def test_same_answer_as_plain(pd, proxy, http, case, mode):
    if mode not in case.modes:
        pytest.skip(f"{case.id} is {'/'.join(case.modes)} only")
    prompt, distinct = _prompts(case, mode)
    body = _body(case, mode, pd.model, prompt)
    extra = case.extra
    if callable(extra):
        greedy = {**_body(case, "non-stream", pd.model, prompt)}
        ref = await _send(http, pd.plain.url, case.path, greedy)
        assert ref.status == 200, ref.body
        extra = extra(ref.body)
    body.update(_formatted(extra, mode))

    pulls_before = _pulls(pd)
    plain, pair = await asyncio.gather(
        _send(http, pd.plain.url, case.path, body), _send(http, proxy, case.path, body)
    )
    _assert_same_answer(plain, pair)
    if "request_id" in body and plain.status == 200 and mode == "non-stream":
        assert pair.body["id"] == plain.body["id"]

    refused = plain.status != 200 or pair.status != 200
    expected = 0 if case.alone or refused else distinct
    if refused and not case.alone:
        # The proxy opens a listed prompt's decode as soon as that prompt's prefill is done; one
        # whose prefill ended before another prompt's refusal may have pulled. The refused
        # prompt never does.
        await asyncio.sleep(0.5)
        assert 0 <= _pulls(pd) - pulls_before <= max(distinct - 1, 0)
    else:
        # A request's pulls end before its first token; the counter follows within a step or two.
        await eventually(lambda: _pulls(pd) - pulls_before >= expected, 10, f"{expected} pulls")
        assert _pulls(pd) - pulls_before == expected
    error = plain.body.get("error") or {} if plain.status != 200 else {}
    OUTCOMES.append((case.id, mode, plain.status, pair.status, expected, error.get("message", "")))


def test_logprob_differences_stay_small():
    """Runs after the matrix: how far plain's and the pair's log-probabilities were apart."""
    for case, mode, plain, pair, pulls, error in OUTCOMES:
        print(f"case {case:<26} {mode:<10} plain {plain} pair {pair} pulls {pulls} {error[:150]}")
    print(f"\nlargest log-probability difference, plain vs pair: {LARGEST_LOGPROB_DIFF[0]:.2e}")
    assert LARGEST_LOGPROB_DIFF[0] <= LOGPROB_TOLERANCE


# ---- beyond single requests ---------------------------------------------------------------------


async def test_models_are_the_decodes(pd, proxy, http):
    async with http.get(pd.plain.url + "/v1/models") as resp:
        plain = await resp.json()
    async with http.get(proxy + "/v1/models") as resp:
        assert resp.status == 200
        pair = await resp.json()
    volatile = {"created", "id"}

    def view(models):
        return [
            {k: v for k, v in m.items() if k not in volatile | {"permission"}} | {"id": m["id"]}
            for m in models["data"]
        ]

    assert view(pair) == view(plain)
    assert pair["object"] == plain["object"] == "list"


async def test_aborted_then_resubmitted_stream_gets_the_same_answer(pd, proxy, http):
    case = Case("resubmit", ())
    body = _body(case, "stream", pd.model, _text(case, "stream", words=60))
    body["max_tokens"] = 400
    body["ignore_eos"] = True
    async with http.post(proxy + COMPLETIONS, json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the first event, then the client goes away
    body["max_tokens"] = MAX_TOKENS
    plain = await _send(http, pd.plain.url, COMPLETIONS, body)
    pair = await _send(http, proxy, COMPLETIONS, body)
    _assert_same_answer(plain, pair)
