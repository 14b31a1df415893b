"""The proxy against fake vLLM servers: what a client sees when backends work, fail, hang or vanish.

The proxy runs for real (its default server on a loopback port, as ``mooncake-vllm-proxy`` runs it;
the other ``--server`` choices in ``test_every_server_streams_and_sees_the_client_leave``); the
backends are small aiohttp servers speaking the OpenAI shapes vLLM speaks, recording what they get.
No vLLM is started: these tests take seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from harness.local_proxy import start_app, wait_for_listener
from harness.servers import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
HANDOFF = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "transfer_id": "from-prefill",
    "remote_block_ids": [3, 4, 5],
    "side_channel_ports": [5600],
}
CLIENT_FORGED_HANDOFF = {"do_remote_prefill": True, "transfer_id": "forged-by-client"}
DECODE_ERROR = {
    "error": {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}
}


# ---- a fake vLLM --------------------------------------------------------------------------------


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]  # case-insensitive, as received


@dataclass(eq=False)
class FakeVllm:
    """An OpenAI-shaped server; a prefill answers with ``handoff`` as its kv_transfer_params."""

    role: str
    handoff: dict[str, Any] | None = None
    status: int = 200  # of generation answers
    error_body: bytes = json.dumps(DECODE_ERROR).encode()
    hang: bool = False  # never answer a generation request
    endless_stream: bool = False  # stream until the client goes away
    drop_mid_stream: bool = False  # close the connection after two chunks
    hold_after_first_chunk: asyncio.Event | None = None
    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    stream_closed: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def sse_chunks(count: int = 4) -> list[bytes]:
        events = [
            {"id": "cmpl-1", "choices": [{"index": 0, "text": f" tok{i}"}]} for i in range(count)
        ]
        return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]

    @staticmethod
    def answer() -> dict[str, Any]:
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [{"index": 0, "text": " hello world", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }

    async def start(self) -> FakeVllm:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner, self.port = await start_app(app, self.port)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def generation_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith("/v1/")]

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _models(self, request: web.Request) -> web.Response:
        self.seen.append(Seen(request.path, {}, request.headers.copy()))
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, body, request.headers.copy()))
        if self.hang:
            await asyncio.sleep(3600)
        if self.status != 200:
            return web.Response(status=self.status, body=self.error_body)
        if not body.get("stream"):
            answer = self.answer()
            if self.role == "prefill":
                answer["kv_transfer_params"] = self.handoff
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        finished = False
        try:
            for i, chunk in enumerate(self.sse_chunks()):
                await response.write(chunk)
                if i == 0 and self.hold_after_first_chunk is not None:
                    await self.hold_after_first_chunk.wait()
                if i == 1 and self.drop_mid_stream:
                    request.transport.close()
                    return response
            while self.endless_stream:
                await asyncio.sleep(0.05)
                await response.write(b": keep-alive\n\n")
            finished = True
        finally:
            if not finished:
                self.stream_closed.set()
        return response


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def fakes(start_fake):
    """Start fake backends with ``await fakes("prefill", handoff=...)``; all stop at test end."""
    return partial(start_fake, FakeVllm)


@pytest.fixture
async def prefill(fakes) -> FakeVllm:
    return await fakes("prefill", handoff=HANDOFF)


@pytest.fixture
async def decode(fakes) -> FakeVllm:
    return await fakes("decode")


@pytest.fixture
async def client():
    async with aiohttp.ClientSession() as session:
        yield session


async def eventually(check, timeout_s: float = 5.0, interval_s: float = 0.05):
    """Poll the async ``check`` until it returns a truthy value; that value, or AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s (last: {result!r})")
        await asyncio.sleep(interval_s)


async def metric_value(client: aiohttp.ClientSession, proxy: str, sample: str) -> float | None:
    async with client.get(proxy + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None


# ---- the happy path -----------------------------------------------------------------------------


async def test_completion_carries_the_prefill_handoff_to_the_decode(
    prefill, decode, start_proxy, client
):
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 8,
        "n": 2,
        "kv_transfer_params": CLIENT_FORGED_HANDOFF,
    }
    async with client.post(
        proxy + "/v1/completions", json=body, headers={"X-Request-Id": "req-1"}
    ) as resp:
        assert resp.status == 200, await resp.text()
        assert await resp.json() == FakeVllm.answer()
        assert resp.headers["X-Request-Id"] == "req-1"

    (prefill_seen,) = prefill.generation_requests()
    assert prefill_seen.path == "/v1/completions"
    assert prefill_seen.body["max_tokens"] == 1
    assert prefill_seen.body["stream"] is False
    assert prefill_seen.body["n"] == 1
    params = prefill_seen.body["kv_transfer_params"]
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert len(params["transfer_id"]) == 32 and params["transfer_id"] != "forged-by-client"

    (decode_seen,) = decode.generation_requests()
    assert decode_seen.path == "/v1/completions"
    assert decode_seen.body == {**body, "kv_transfer_params": HANDOFF}
    assert prefill_seen.headers["X-Request-Id"] == decode_seen.headers["X-Request-Id"] == "req-1"


async def test_chat_stream_passes_the_decode_events_through_unchanged(
    prefill, decode, start_proxy, client
):
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.post(proxy + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Request-Id"]
        received = await resp.read()
    assert received == b"".join(FakeVllm.sse_chunks())

    (prefill_seen,) = prefill.generation_requests()
    assert prefill_seen.path == "/v1/chat/completions"
    assert prefill_seen.body["max_tokens"] == prefill_seen.body["max_completion_tokens"] == 1
    assert prefill_seen.body["stream"] is False
    assert "stream_options" not in prefill_seen.body
    (decode_seen,) = decode.generation_requests()
    assert decode_seen.body == {**body, "kv_transfer_params": HANDOFF}


async def test_stream_chunks_reach_the_client_as_they_are_produced(
    fakes, prefill, start_proxy, client
):
    hold = asyncio.Event()
    decode = await fakes("decode", hold_after_first_chunk=hold)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    async with client.post(
        proxy + "/v1/completions", json={"prompt": "hi", "stream": True}
    ) as resp:
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=3)
        assert first == FakeVllm.sse_chunks()[0]  # while the decode still holds the rest
        hold.set()
        rest = await resp.read()
    assert first + rest == b"".join(FakeVllm.sse_chunks())


async def test_prefill_without_handoff_still_answers_and_is_counted(
    fakes, decode, start_proxy, client
):
    prefill = await fakes("prefill", handoff=None)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    async with client.post(
        proxy + "/v1/completions", json={"prompt": "x", "kv_transfer_params": {"a": 1}}
    ) as resp:
        assert resp.status == 200
    (decode_seen,) = decode.generation_requests()
    assert "kv_transfer_params" not in decode_seen.body
    sample = f'mooncake_proxy_missing_kv_transfer_params_total{{backend="{prefill.url}"}}'
    assert await metric_value(client, proxy, sample) == 1.0


async def test_models_come_from_a_decode(prefill, decode, start_proxy, client):
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    async with client.get(proxy + "/v1/models") as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == "tiny"
    assert [s.path for s in decode.seen] == ["/v1/models"]


# ---- backends that fail -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_with_no_prefill_the_decode_computes_the_prompt_and_health_says_degraded(
    decode, start_proxy, client, stream
):
    dead_prefill = f"http://127.0.0.1:{free_port()}"
    proxy = await start_proxy(prefill=[dead_prefill], decode=[decode.url])
    for _ in range(3):  # the first finds it down, the others find the pool empty
        body = {"prompt": "x", "stream": stream, "kv_transfer_params": CLIENT_FORGED_HANDOFF}
        async with client.post(proxy + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert "tok" in await resp.text() if stream else "hello" in await resp.text()
    seen = decode.generation_requests()
    assert len(seen) == 3
    # A plain request: no handoff (the client's is never passed on), the client's max_tokens.
    assert all("kv_transfer_params" not in s.body for s in seen)
    sample = 'mooncake_proxy_dispatched_total{how="local"}'
    assert await metric_value(client, proxy, sample) == 3.0

    async with client.get(proxy + "/health") as resp:
        assert resp.status == 200
        report = await resp.json()
    assert report["status"] == "degraded"
    assert report["prefill"][0]["url"] == dead_prefill
    assert report["prefill"][0]["healthy"] is False
    assert report["decode"][0]["healthy"] is True


async def test_with_no_backend_at_all_health_is_503_and_requests_fail(start_proxy, client):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    proxy = await start_proxy(prefill=[dead[0]], decode=[dead[1]])
    async with client.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status in (502, 503)  # 503 once the first probe has ejected it
        assert "decode" in (await resp.json())["error"]["message"]
    async with client.get(proxy + "/health") as resp:
        assert resp.status == 503
        assert (await resp.json())["status"] == "unavailable"


async def test_health_is_ok_when_both_pools_are_up(prefill, decode, start_proxy, client):
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    async with client.get(proxy + "/health") as resp:
        assert resp.status == 200
        report = await resp.json()
    assert report["status"] == "ok"
    assert [b["url"] for b in report["prefill"]] == [prefill.url]
    assert [b["url"] for b in report["decode"]] == [decode.url]


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_error_status_reaches_the_client(fakes, prefill, start_proxy, client, stream):
    decode = await fakes("decode", status=400)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    async with client.post(
        proxy + "/v1/completions", json={"prompt": "x", "stream": stream}
    ) as resp:
        assert resp.status == 400
        assert resp.headers["Content-Type"].startswith("application/json")
        assert await resp.json() == DECODE_ERROR


async def test_non_json_backend_error_is_wrapped(fakes, prefill, start_proxy, client):
    decode = await fakes("decode", status=500, error_body=b"Internal Server Error")
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    async with client.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 500
        error = (await resp.json())["error"]
    assert error["message"] == "decode backend answered HTTP 500: Internal Server Error"


async def test_prefill_error_stops_the_request_before_decode(fakes, decode, start_proxy, client):
    prefill = await fakes("prefill", status=400)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    async with client.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 400
        assert await resp.json() == DECODE_ERROR
    assert decode.generation_requests() == []
    # An HTTP error is the backend's answer, not a dead backend: it stays in rotation.
    async with client.get(proxy + "/health") as resp:
        assert resp.status == 200


async def test_hanging_prefill_times_out_with_504(fakes, decode, start_proxy, client):
    prefill = await fakes("prefill", handoff=HANDOFF, hang=True)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], prefill_timeout_s=0.5)
    started = time.monotonic()
    async with client.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 504
        error = (await resp.json())["error"]
    assert 0.4 < time.monotonic() - started < 4
    assert error["type"] == "timeout"
    assert "timed out after 0.5s" in error["message"]
    assert "--prefill-timeout-s" in error["message"]
    assert decode.generation_requests() == []


@pytest.mark.parametrize("stream", [False, True])
async def test_hanging_decode_times_out_with_504(fakes, prefill, start_proxy, client, stream):
    decode = await fakes("decode", hang=True)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], timeout_s=1.0)
    started = time.monotonic()
    async with client.post(
        proxy + "/v1/completions", json={"prompt": "x", "stream": stream}
    ) as resp:
        assert resp.status == 504
        error = (await resp.json())["error"]
    assert 0.8 < time.monotonic() - started < 4.5
    assert error["type"] == "timeout"
    assert "decode" in error["message"] and "--timeout-s" in error["message"]


async def test_client_disconnect_mid_stream_closes_the_decode_stream(
    fakes, prefill, start_proxy, client
):
    decode = await fakes("decode", endless_stream=True)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    resp = await client.post(proxy + "/v1/completions", json={"prompt": "x", "stream": True})
    assert resp.status == 200
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=3)
    resp.close()  # the client goes away

    await asyncio.wait_for(decode.stream_closed.wait(), timeout=3)
    gauge = f'mooncake_proxy_backend_in_flight{{backend="{decode.url}",role="decode"}}'

    async def idle():
        return await metric_value(client, proxy, gauge) == 0.0

    await eventually(idle, timeout_s=3)


@pytest.mark.parametrize("server", ["granian", "uvicorn", "hypercorn"])
async def test_every_server_streams_and_sees_the_client_leave(
    fakes, prefill, decode, start_proxy, client, server
):
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], server=server)
    body = {"prompt": "x", "stream": True}
    async with client.post(proxy + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert await resp.read() == b"".join(FakeVllm.sse_chunks())
    async with client.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"]
    streamed, whole = decode.generation_requests()
    assert streamed.body == {**body, "kv_transfer_params": HANDOFF}
    assert whole.body == {"prompt": "x", "kv_transfer_params": HANDOFF}
    endless = await fakes("decode", endless_stream=True)
    proxy = await start_proxy(prefill=[prefill.url], decode=[endless.url], server=server)
    resp = await client.post(proxy + "/v1/completions", json=body)
    assert resp.status == 200
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=3)
    resp.close()  # the client goes away: the decode stream must close
    await asyncio.wait_for(endless.stream_closed.wait(), timeout=3)


async def test_stream_past_the_request_deadline_ends_with_a_timeout_event(
    fakes, prefill, start_proxy, client
):
    decode = await fakes("decode", endless_stream=True)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], timeout_s=1.0)
    started = time.monotonic()
    async with client.post(proxy + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
        assert resp.status == 200
        received = await asyncio.wait_for(resp.read(), timeout=5)
    assert 0.8 < time.monotonic() - started < 4.5
    assert received.startswith(FakeVllm.sse_chunks()[0])
    last = json.loads(received.rstrip(b"\n").rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
    assert last["error"]["type"] == "timeout"
    assert "timed out after 1s (--timeout-s)" in last["error"]["message"]
    await asyncio.wait_for(decode.stream_closed.wait(), timeout=3)


async def test_prefix_policy_sends_a_shared_prefix_to_one_prefill(
    fakes, decode, start_proxy, client
):
    prefills = [await fakes("prefill") for _ in range(2)]
    proxy = await start_proxy(
        prefill=[p.url for p in prefills], decode=[decode.url], policy="prefix"
    )
    systems = [f"System prompt {i}: answer as team {i} would. " * 8 for i in range(8)]
    for turn in range(3):  # every system prompt, three turns each
        for system in systems:
            body = {"prompt": system + " Q" * (turn + 1), "max_tokens": 2}
            async with client.post(proxy + "/v1/completions", json=body) as resp:
                assert resp.status == 200
    seen = {p.url: {r.body["prompt"][:40] for r in p.generation_requests()} for p in prefills}
    # Each system prompt went to one prefill only, and both prefills got some.
    assert not (seen[prefills[0].url] & seen[prefills[1].url])
    assert all(seen.values())
    assert sum(len(p.generation_requests()) for p in prefills) == 3 * len(systems)


async def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(
    fakes, prefill, start_proxy, client
):
    decode = await fakes("decode", drop_mid_stream=True)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    async with client.post(proxy + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
        assert resp.status == 200
        received = await asyncio.wait_for(resp.read(), timeout=5)
    events = [e for e in received.split(b"\n\n") if e]
    assert [e + b"\n\n" for e in events[:2]] == FakeVllm.sse_chunks()[:2]
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert "decode backend" in last["error"]["message"]


async def test_requests_keep_succeeding_when_one_of_two_prefills_dies(
    fakes, decode, start_proxy, client
):
    doomed = await fakes("prefill", handoff=HANDOFF)
    survivor = await fakes("prefill", handoff=HANDOFF)
    proxy = await start_proxy(prefill=[doomed.url, survivor.url], decode=[decode.url])
    for _ in range(2):
        async with client.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 200
    assert len(doomed.generation_requests()) == len(survivor.generation_requests()) == 1

    await doomed.stop()
    for _ in range(6):
        async with client.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 200, await resp.text()
    assert len(survivor.generation_requests()) == 7
    assert len(decode.generation_requests()) == 8

    sample = f'mooncake_proxy_backend_ejections_total{{backend="{doomed.url}",role="prefill"}}'
    assert await metric_value(client, proxy, sample) == 1.0


async def test_an_ejected_prefill_comes_back_when_it_answers_again(
    fakes, decode, start_proxy, client
):
    prefill = await fakes("prefill", handoff=HANDOFF)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    await prefill.stop()
    async with client.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 200  # the decode computed it
    assert "kv_transfer_params" not in decode.generation_requests()[-1].body

    revived = await fakes("prefill", handoff=HANDOFF, port=prefill.port)

    async def healthy():
        async with client.get(proxy + "/health") as resp:
            return (await resp.json())["status"] == "ok"

    await eventually(healthy, timeout_s=4)  # first re-probe is 1 s after the ejection
    async with client.post(proxy + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 200
    assert len(revived.generation_requests()) == 1


# ---- what the proxy refuses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "status", "param"),
    [
        ("/v1/completions", b'{"prompt": "x",', 400, None),
        ("/v1/completions", b'["not", "an", "object"]', 400, None),
        ("/v1/completions", b'{"max_tokens": 4}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{}], "n": 0}', 400, "n"),
        ("/v1/completions", json.dumps({"prompt": "x" * 5000}).encode(), 413, None),
    ],
)
async def test_bad_input_is_refused_before_any_backend_sees_it(
    prefill, decode, start_proxy, client, path, raw, status, param
):
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], max_body_bytes=4096)
    async with client.post(
        proxy + path, data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param is not None:
        assert param in error["message"]
    if status == 413:
        assert "--max-body-bytes" in error["message"]
    assert prefill.generation_requests() == decode.generation_requests() == []


async def test_unknown_paths_get_json_errors(prefill, decode, start_proxy, client):
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    async with client.get(proxy + "/nope") as resp:
        assert resp.status == 404
        assert "error" in await resp.json()
    async with client.get(proxy + "/v1/completions") as resp:
        assert resp.status == 405
        assert "error" in await resp.json()


async def test_api_key_is_required_and_not_forwarded(
    prefill, decode, start_proxy, client, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", "backend-key")
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], api_key="proxy-key")
    body = {"prompt": "x"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "proxy-key"}):
        async with client.post(proxy + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
    assert prefill.generation_requests() == decode.generation_requests() == []

    good = {"Authorization": "Bearer proxy-key"}
    async with client.post(proxy + "/v1/completions", json=body, headers=good) as resp:
        assert resp.status == 200
    for seen in prefill.generation_requests() + decode.generation_requests():
        assert seen.headers["Authorization"] == "Bearer backend-key"
    async with client.get(proxy + "/health") as resp:  # probes need no key
        assert resp.status == 200


async def test_client_authorization_is_forwarded_without_proxy_key(
    prefill, decode, start_proxy, client, monkeypatch
):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    headers = {"Authorization": "Bearer client-key"}
    async with client.post(
        proxy + "/v1/completions", json={"prompt": "x"}, headers=headers
    ) as resp:
        assert resp.status == 200
    for seen in prefill.generation_requests() + decode.generation_requests():
        assert seen.headers["Authorization"] == "Bearer client-key"


# ---- observability and process lifecycle --------------------------------------------------------


async def test_metrics_expose_every_proxy_metric(prefill, decode, start_proxy, client):
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    for stream in (False, True):
        async with client.post(
            proxy + "/v1/completions", json={"prompt": "x", "stream": stream}
        ) as resp:
            assert resp.status == 200
            await resp.read()
    async with client.get(proxy + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    for name in (
        "mooncake_proxy_requests_total",
        "mooncake_proxy_prefill_seconds_bucket",
        "mooncake_proxy_time_to_first_decode_byte_seconds_bucket",
        "mooncake_proxy_backend_in_flight",
        "mooncake_proxy_backend_errors_total",
        "mooncake_proxy_backend_ejections_total",
        "mooncake_proxy_missing_kv_transfer_params_total",
    ):
        assert name in text
    assert 'mooncake_proxy_requests_total{endpoint="/v1/completions",status="200"} 2.0' in text
    assert "mooncake_proxy_time_to_first_decode_byte_seconds_count 2.0" in text


async def test_proxy_script_serves_and_stops_cleanly_on_sigterm(prefill, decode, client):
    port = free_port()
    argv = [sys.executable, str(REPO_ROOT / "proxy" / "proxy_server.py")]
    argv += ["--prefill", prefill.url, "--decode", decode.url, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        await wait_for_listener(f"http://127.0.0.1:{port}", timeout_s=60)  # a loaded CI box
        async with client.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}
        ) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.to_thread(proc.communicate, timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert "SIGTERM received" in output and "proxy stopped" in output


def test_proxy_script_rejects_a_bad_url_naming_the_flag():
    argv = [sys.executable, str(REPO_ROOT / "proxy" / "proxy_server.py")]
    argv += ["--prefill", "http://127.0.0.1:1", "--decode", "127.0.0.1:2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=REPO_ROOT)
    assert done.returncode == 2
    assert "--decode" in done.stderr and "127.0.0.1:2" in done.stderr
