"""A list of prompts through the proxy, against fake backends: one prefill leg per distinct
prompt, each decode request with its own prompt's handoff, answers merged as vLLM merges them,
and a failing prompt failing the whole request with the others cancelled.

The fakes answer per prompt (text ``<prompt>#<choice>``, a handoff naming the prompt) so every
mix-up shows; no vLLM is started. The real thing: ``tests/test_api_matrix_e2e.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from harness.local_proxy import start_app


def _key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else ",".join(map(str, prompt))


@dataclass(eq=False)
class PromptFake:
    """An OpenAI-shaped completions server answering each prompt with its own text."""

    role: str
    fail_prompt: str | None = None  # a request for this prompt gets a 400
    hold_prompt: str | None = None  # a request for this prompt never ends (streams forever)
    port: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)  # prompts whose request the proxy dropped
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> PromptFake:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        self._runner, self.port = await start_app(app)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        key = _key(body["prompt"])
        if key == self.fail_prompt:
            error = {"error": {"message": f"bad prompt {key}", "type": "BadRequestError",
                               "param": "prompt", "code": 400}}  # fmt: skip
            return web.json_response(error, status=400)
        n = body.get("n") or 1
        if not body.get("stream"):
            answer = {
                "id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": i, "text": f"<{key}>#{i}", "finish_reason": "length"}
                            for i in range(n)],
                "usage": {"prompt_tokens": len(key), "completion_tokens": 2 * n,
                          "total_tokens": len(key) + 2 * n},
            }  # fmt: skip
            if self.role == "prefill":
                answer["kv_transfer_params"] = {"transfer_id": f"t-{key}"}
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(n):
                for part in (f"<{key}>", f"#{i}"):
                    event = {"id": "cmpl-x", "object": "text_completion", "created": 1,
                             "model": "m", "choices": [{"index": i, "text": part}]}  # fmt: skip
                    # One event written in two pieces: the proxy must not cut it.
                    raw = f"data: {json.dumps(event)}\n\n".encode()
                    await response.write(raw[:9])
                    await asyncio.sleep(0.001)
                    await response.write(raw[9:])
            while key == self.hold_prompt:
                await asyncio.sleep(0.05)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "prompt_tokens": len(key),
                    "completion_tokens": 2 * n,
                    "total_tokens": len(key) + 2 * n,
                }
                event = {"id": "cmpl-x", "object": "text_completion", "created": 1,
                         "model": "m", "choices": [], "usage": usage}  # fmt: skip
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.closed.append(key)
            raise
        return response


@pytest.fixture
def fakes(start_fake):
    return partial(start_fake, PromptFake)


@pytest.fixture
def proxy_for(start_proxy):
    """``await proxy_for(prefill, decode)`` → the URL of a proxy in front of the two fakes."""
    return lambda prefill, decode: start_proxy(prefill=[prefill.url], decode=[decode.url])


@pytest.fixture
async def client():
    async with aiohttp.ClientSession() as session:
        yield session


async def _post(client, url: str, body: dict) -> tuple[int, Any]:
    async with client.post(url + "/v1/completions", json=body) as resp:
        if not body.get("stream") or resp.status != 200:
            return resp.status, await resp.json()
        events = []
        async for line in resp.content:
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return resp.status, events


PROMPTS = {
    "strings": ["alpha", "beta", "gamma"],
    "token ids": [[5, 6], [7], [8, 9, 10]],
}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kind", list(PROMPTS))
async def test_each_prompt_has_its_own_legs_and_the_answer_is_merged(
    fakes, proxy_for, client, kind, n
):
    prefill, decode = await fakes("prefill"), await fakes("decode")
    url = await proxy_for(prefill, decode)
    prompts = PROMPTS[kind]
    status, answer = await _post(client, url, {"prompt": prompts, "n": n, "max_tokens": 4})
    assert status == 200, answer
    keys = [_key(p) for p in prompts]
    assert [c["text"] for c in answer["choices"]] == [f"<{k}>#{j}" for k in keys for j in range(n)]
    assert [c["index"] for c in answer["choices"]] == list(range(len(prompts) * n))
    prompt_tokens = sum(len(k) for k in keys)
    assert answer["usage"] == {"prompt_tokens": prompt_tokens,
                               "completion_tokens": 2 * n * len(keys),
                               "total_tokens": prompt_tokens + 2 * n * len(keys)}  # fmt: skip
    assert sorted(_key(b["prompt"]) for b in prefill.seen) == sorted(keys)
    assert all(b["n"] == 1 and b["max_tokens"] == 1 for b in prefill.seen)
    # Each decode request carries its own prompt's handoff, and the client's n.
    assert sorted(_key(b["prompt"]) for b in decode.seen) == sorted(keys)
    for body in decode.seen:
        assert body["kv_transfer_params"] == {"transfer_id": f"t-{_key(body['prompt'])}"}
        assert body.get("n") == n


@pytest.mark.parametrize("n", [1, 2])
async def test_streams_are_merged_with_indexes_usage_and_one_done(fakes, proxy_for, client, n):
    prefill, decode = await fakes("prefill"), await fakes("decode")
    url = await proxy_for(prefill, decode)
    prompts = ["alpha", "beta", "gamma"]
    body = {"prompt": prompts, "n": n, "stream": True, "stream_options": {"include_usage": True}}
    status, events = await _post(client, url, body)
    assert status == 200
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 5 + 4 + 5
    assert usage["usage"]["completion_tokens"] == 2 * n * 3
    texts: dict[int, str] = {}
    for event in events[:-2]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {p * n + j: f"<{k}>#{j}" for p, k in enumerate(prompts) for j in range(n)}
    assert all("stream_options" not in b and b["stream"] is False for b in prefill.seen)


async def test_a_repeated_prompt_is_prefilled_once_and_its_decodes_share_the_handoff(
    fakes, proxy_for, client
):
    prefill, decode = await fakes("prefill"), await fakes("decode")
    url = await proxy_for(prefill, decode)
    status, answer = await _post(client, url, {"prompt": ["same", "other", "same"]})
    assert status == 200
    assert [c["text"] for c in answer["choices"]] == ["<same>#0", "<other>#0", "<same>#0"]
    assert sorted(b["prompt"] for b in prefill.seen) == ["other", "same"]
    handoffs = [b["kv_transfer_params"]["transfer_id"] for b in decode.seen]
    assert sorted(handoffs) == ["t-other", "t-same", "t-same"]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("failing", ["prefill", "decode"])
async def test_a_failing_prompt_fails_the_request_and_cancels_the_others(
    fakes, proxy_for, client, failing, stream
):
    prefill = await fakes("prefill", fail_prompt="beta" if failing == "prefill" else None)
    decode = await fakes(
        "decode", fail_prompt="beta" if failing == "decode" else None, hold_prompt="alpha"
    )
    url = await proxy_for(prefill, decode)
    body = {"prompt": ["alpha", "beta"], "stream": stream}
    status, answer = await _post(client, url, body)
    assert status == 400
    assert answer["error"]["message"] == "bad prompt beta"
    if stream and failing == "decode":
        await asyncio.sleep(0.2)
        # alpha's stream was open when beta failed: the proxy closed it.
        assert decode.closed == ["alpha"] or [b["prompt"] for b in decode.seen] == ["beta"]


async def test_a_single_prompt_list_goes_through_unsplit(fakes, proxy_for, client):
    prefill, decode = await fakes("prefill"), await fakes("decode")
    url = await proxy_for(prefill, decode)
    status, answer = await _post(client, url, {"prompt": ["only"]})
    assert status == 200, answer
    assert [b["prompt"] for b in prefill.seen] == [["only"]]
    assert [b["prompt"] for b in decode.seen] == [["only"]]


async def test_client_leaving_a_merged_stream_closes_every_decode(fakes, proxy_for, client):
    prefill = await fakes("prefill")
    decode = await fakes("decode", hold_prompt="alpha")
    url = await proxy_for(prefill, decode)
    body = {"prompt": ["alpha", "alpha2"], "stream": True}
    async with client.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()
    deadline = time.monotonic() + 5
    while "alpha" not in decode.closed:
        assert time.monotonic() < deadline, decode.closed
        await asyncio.sleep(0.05)
