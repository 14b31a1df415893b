"""Wrongly typed ``kv_transfer_params`` sent straight to a real decode's OpenAI API (issue 47).

One request with ``transfer_id`` a dict once ended a decode engine: our scheduler hook raised
inside vLLM's ``schedule()``. Here every field the connector reads is sent as an object, an
array, a number and null, one request each, to the shared cluster's decode (vLLM's
``recompute`` policy) and to its ``both`` engine (``fail``): each gets an answer (the decode's
is the plain vLLM's text, token for token: refused through the policy, then computed there),
the refusals are counted as failed pulls, one each, and afterwards both engines still serve a
handover from the prefill token-exact and by transfer.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from test_connector_e2e import body, prefill_body, prompts

from harness.pd import complete, eventually, tokens_by_transfer
from mooncake_vllm.p2p.params import ParamTypes

pytestmark = [pytest.mark.servers, pytest.mark.provokes_pull_failure]

FIELDS = list(ParamTypes.__struct_fields__)
WRONG = {"object": {"x": 1}, "array": [1], "number": 7, "null": None}
CONCURRENCY = 8


def _base() -> dict:
    """Upstream's decode leg, naming a bootstrap nobody serves: with a field at null, the pull
    is tried and fails at once (connection refused) instead of waiting for a lease."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": f"xfer-{uuid.uuid4()}",
        "remote_engine_id": "nobody",
        "remote_bootstrap_addr": "http://127.0.0.1:9",
    }


def _cases() -> list[tuple[str, dict]]:
    return [
        (f"{field}={kind}", {**_base(), field: value})
        for field in FIELDS
        for kind, value in WRONG.items()
    ]


async def _send_all(http, url: str, prompt: list[int], model: str) -> dict[str, tuple[int, dict]]:
    """Every case, ``CONCURRENCY`` at a time: its status and JSON answer."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(params: dict) -> tuple[int, dict]:
        async with gate:
            payload = body(model, prompt, kv_transfer_params=params, return_token_ids=True)
            async with http.post(f"{url}/v1/completions", json=payload) as resp:
                return resp.status, await resp.json(content_type=None)

    cases = _cases()
    answers = await asyncio.gather(*(one(params) for _, params in cases))
    return dict(zip((name for name, _ in cases), answers, strict=True))


# Upstream's decode leg names its producer by these: one that cannot be used is not claimed (the
# decode computes the prompt, as vLLM's upstream connector does).
UPSTREAM_NAMES = ("transfer_id", "remote_engine_id", "remote_bootstrap_addr")


def _asks(name: str) -> bool:
    """The case asks for a remote prefill that is claimed, and refused once: all but
    do_remote_prefill at null and an unusable transfer id, engine id or bootstrap address."""
    return name != "do_remote_prefill=null" and name.split("=")[0] not in UPSTREAM_NAMES


async def test_wrong_types_in_every_field_are_answered_and_the_decode_serves_on(pd, http):
    prompt = prompts(seed=4701, lengths=[200])[0]
    ref = await complete(http, pd.plain, body(pd.model, prompt))
    failures0 = pd.decode.metric("mooncake_vllm:pull_failures_total")
    answers = await _send_all(http, pd.decode.url, prompt, pd.model)
    for name, (status, data) in answers.items():
        assert status == 200, (name, data)
        assert data["choices"][0]["token_ids"] == ref.token_ids, name  # recomputed, exactly
    refused = sum(_asks(name) for name in answers)
    await eventually(
        lambda: pd.decode.metric("mooncake_vllm:pull_failures_total") == failures0 + refused,
        what=f"{refused} refused loads counted",
    )
    # Not a JSON object at all: vLLM's own request model answers 400.
    for value in ([1], 7, "x"):
        payload = body(pd.model, prompt, kv_transfer_params=value)
        async with http.post(f"{pd.decode.url}/v1/completions", json=payload) as resp:
            assert resp.status == 400, value
    await _a_handover_still_works(pd, http, pd.decode, seed=4702)


async def test_under_the_fail_policy_each_is_an_error_answer_and_the_engine_serves_on(pd, http):
    prompt = prompts(seed=4703, lengths=[200])[0]
    failures0 = pd.both.metric("mooncake_vllm:pull_failures_total")
    answers = await _send_all(http, pd.both.url, prompt, pd.model)
    for name, (status, data) in answers.items():
        if _asks(name):
            assert status >= 400, (name, data)  # failed through the policy, answered
        else:
            assert status == 200, (name, data)
    refused = sum(_asks(name) for name in answers)
    await eventually(
        lambda: pd.both.metric("mooncake_vllm:pull_failures_total") == failures0 + refused,
        what=f"{refused} refused loads counted",
    )
    await _a_handover_still_works(pd, http, pd.both, seed=4704)


async def _a_handover_still_works(pd, http, consumer, seed: int) -> None:
    prompt = prompts(seed=seed, lengths=[300])[0]
    ref = await complete(http, pd.plain, body(pd.model, prompt))
    by_transfer0 = tokens_by_transfer(consumer)
    failures0 = consumer.metric("mooncake_vllm:pull_failures_total")
    head = await complete(http, pd.prefill, prefill_body(pd.model, prompt))
    got = await complete(
        http, consumer, body(pd.model, prompt, kv_transfer_params=head.kv_transfer_params)
    )
    assert got.token_ids == ref.token_ids
    await eventually(lambda: tokens_by_transfer(consumer) > by_transfer0, what="KV by transfer")
    assert consumer.metric("mooncake_vllm:pull_failures_total") == failures0
