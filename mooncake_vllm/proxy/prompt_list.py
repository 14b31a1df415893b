"""A /v1/completions request with several prompts, served as one request per prompt.

vLLM runs a list of prompts as one engine request per prompt but answers with the
``kv_transfer_params`` of the first only, so one prefill leg cannot hand a decode the KV of every
prompt. The proxy sends one prefill leg per distinct prompt and one decode request per prompt
(requests for the same prompt share its handoff: the decode pulls it once), and merges the
answers the way vLLM's ``OpenAIServingCompletion`` answers the list itself
(``vllm/entrypoints/openai/completion/serving.py``):

- not streamed: the choices of prompt 0, then of prompt 1, ..., each ``index`` its position
  (prompt i, choice j of n: i * n + j); ``usage`` summed, ``prompt_tokens_details`` of the last
  prompt; the ``id``, ``created`` and ``model`` of the first answer;
- streamed: each prompt's events as they come, each choice's ``index`` moved to i * n + j and
  the ``id`` and ``created`` of the first event; the usage chunks
  (``stream_options.include_usage``) summed into one after the last event, then one ``[DONE]``.
  An error event from any prompt is passed on and ends the stream (then ``[DONE]``, as vLLM).

Pure: no I/O. ``fanout.py`` sends the requests and feeds their answers here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import msgspec

from mooncake_vllm.proxy.rewrite import InvalidRequest

Prompt = str | list[int]

_DONE = b"data: [DONE]\n\n"
_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def prompts_to_split(body: dict[str, Any]) -> list[Prompt] | None:
    """The prompts of a validated completion body that holds several, else None.

    A string, one list of token ids, or a list holding one prompt is one prompt: it goes
    through the two legs unchanged, as before.
    """
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2 or isinstance(prompt[0], int):
        return None
    return list(prompt)


def check_prompt_count(body: dict[str, Any], max_prompts: int) -> None:
    """Refuse a completion whose ``prompt`` list holds more than ``max_prompts`` prompts
    (``--max-prompts``): each would be a prefill leg and a decode request of its own."""
    prompts = prompts_to_split(body)
    if prompts is not None and len(prompts) > max_prompts:
        raise InvalidRequest(
            f"'prompt' holds {len(prompts)} prompts; at most {max_prompts} are accepted in one "
            "request (--max-prompts): send the list in several requests",
            "prompt",
        )


@dataclass(frozen=True)
class Plan:
    """Which prefill leg serves which prompt: ``distinct[leg_of[i]]`` is prompt i."""

    distinct: list[Prompt]
    leg_of: list[int]


def plan(prompts: list[Prompt]) -> Plan:
    """One prefill leg per distinct prompt, in order of first appearance."""
    first_leg: dict[Any, int] = {}
    distinct: list[Prompt] = []
    leg_of: list[int] = []
    for prompt in prompts:
        key = prompt if isinstance(prompt, str) else tuple(prompt)
        if key not in first_leg:
            first_leg[key] = len(distinct)
            distinct.append(prompt)
        leg_of.append(first_leg[key])
    return Plan(distinct, leg_of)


def body_for(body: dict[str, Any], prompt: Prompt) -> dict[str, Any]:
    """The client's request for one of its prompts."""
    return {**body, "prompt": prompt}


def _summed_usage(usages: list[dict[str, Any]], cached_from: dict[str, Any]) -> dict[str, Any]:
    """The first usage with the counts summed and the ``prompt_tokens_details`` (cached tokens)
    of ``cached_from``, as vLLM reports them for the list."""
    usage = dict(usages[0])
    for key in _USAGE_COUNTS:
        usage[key] = sum(u.get(key) or 0 for u in usages)
    if "prompt_tokens_details" in cached_from:
        usage["prompt_tokens_details"] = cached_from["prompt_tokens_details"]
    return usage


def merge_answers(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer to the list from the answers to its prompts, in prompt order."""
    merged = copy.copy(answers[0])
    choices: list[dict[str, Any]] = []
    for answer in answers:
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": len(choices)})
    merged["choices"] = choices
    usages = [a["usage"] for a in answers if isinstance(a.get("usage"), dict)]
    if usages:
        # vLLM reports the cached tokens of the last prompt's request.
        merged["usage"] = _summed_usage(usages, usages[-1])
    if merged.get("metrics") is not None:
        merged["metrics"] = None  # vLLM's per-request metrics describe one request only
    return merged


class StreamMerge:
    """Merges the SSE streams of a list's prompts into the one stream vLLM sends for the list.

    ``feed(prompt, chunk)`` takes the bytes of prompt ``prompt``'s stream as they arrive and
    returns the complete events to send now (a partial event waits for its end, so the merged
    stream never holds half an event); ``finish()`` returns what ends the stream. Events are
    ``data: ...`` blocks ending in a blank line, as vLLM writes them; other blocks (comments
    such as keep-alives) pass unchanged.
    """

    def __init__(self, prompts: int, choices_per_prompt: int) -> None:
        self._n = choices_per_prompt
        self._pending = [b""] * prompts
        self._usage: dict[int, dict[str, Any]] = {}
        self._first_prompt: int | None = None  # whose event came first: its id and created
        self._id: Any = None
        self._created: Any = None
        self.failed = False  # an error event was passed on: the stream must end

    def feed(self, prompt: int, chunk: bytes) -> bytes:
        data = self._pending[prompt] + chunk
        *events, self._pending[prompt] = data.split(b"\n\n")
        return b"".join(self._event(prompt, event) for event in events if event.strip())

    def finish(self) -> bytes:
        """The merged usage chunk if the prompts' streams carried one, then ``[DONE]``."""
        if self.failed or not self._usage:
            return _DONE
        first = self._first_prompt if self._first_prompt in self._usage else min(self._usage)
        chunk = dict(self._usage[first])
        usages = [self._usage[p]["usage"] for p in sorted(self._usage)]
        # vLLM reports the cached tokens of the request whose output came first.
        chunk["usage"] = _summed_usage(usages, self._usage[first]["usage"])
        self._stamp(chunk)
        return _data(chunk) + _DONE

    def _event(self, prompt: int, event: bytes) -> bytes:
        if self.failed:
            return b""  # vLLM ends the stream at its error event
        if not event.startswith(b"data:"):
            return event + b"\n\n"
        payload = event[5:].strip()
        if payload == b"[DONE]":
            return b""  # one [DONE] for the list, from finish()
        try:
            message = msgspec.json.decode(payload)
        except msgspec.MsgspecError:
            return event + b"\n\n"
        if not isinstance(message, dict):
            return event + b"\n\n"
        if "error" in message:
            self.failed = True
            return event + b"\n\n"
        if self._first_prompt is None:
            self._first_prompt = prompt
            self._id, self._created = message.get("id"), message.get("created")
        choices = message.get("choices")
        if choices == [] and isinstance(message.get("usage"), dict):
            self._usage[prompt] = message  # summed into one usage chunk by finish()
            return b""
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and isinstance(choice.get("index"), int):
                    choice["index"] += prompt * self._n
        self._stamp(message)
        return _data(message)

    def _stamp(self, message: dict[str, Any]) -> None:
        if "id" in message:
            message["id"] = self._id
        if "created" in message:
            message["created"] = self._created


def _data(message: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(message) + b"\n\n"
