"""A backend that is shutting down (vLLM's ``--shutdown-timeout`` drain): how the proxy tells its
refusals apart, keeps it out of rotation until it has restarted, and sends the leg elsewhere.

The refusals below are what a draining vLLM 0.32 answers (``mooncake_vllm/proxy/drain.py``; seen
in ``test_xpyd_e2e``'s rolling restart): while its engine drains, HTTP 200 with every choice
finished by ``"abort"`` and no token (a stream: ``[DONE]`` alone); once its engine has exited,
HTTP 500 with vLLM's EngineDeadError message. The proxy runs in this process against small
aiohttp fakes; no vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from harness.local_proxy import proxies
from harness.servers import free_port
from mooncake_vllm.proxy import drain, http1
from mooncake_vllm.proxy.app import MAX_RELOADS
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.failover import Backends, RequestContext
from mooncake_vllm.proxy.metrics import ProxyMetrics
from mooncake_vllm.proxy.routing import DRAIN_RECHECK_S, BackendPool

# ---- what a refusal looks like ------------------------------------------------------------------


def _answer(*choices: dict[str, Any]) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "choices": list(choices)}


ABORTED = {"index": 0, "text": "", "finish_reason": "abort"}
ABORTED_CHAT = {"index": 0, "message": {"role": "assistant", "content": ""},
                "finish_reason": "abort"}  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "is_refusal"),
    [
        (_answer(ABORTED), True),
        (_answer(ABORTED_CHAT), True),
        (_answer(ABORTED, {**ABORTED, "index": 1}), True),  # n=2 or a prompt list
        (_answer({**ABORTED, "token_ids": None}), True),
        (_answer({**ABORTED, "text": " partial"}), False),  # aborted after a token
        (_answer({**ABORTED, "token_ids": [7]}), False),
        (_answer({**ABORTED_CHAT, "message": {"content": "hi"}}), False),
        (_answer({**ABORTED, "finish_reason": "length"}), False),
        (_answer({**ABORTED, "finish_reason": "stop"}), False),  # an empty answer, but an answer
        (_answer(ABORTED, {**ABORTED, "index": 1, "finish_reason": "length"}), False),
        (_answer(), False),
        ({"object": "list", "data": []}, False),  # /v1/models
        ([], False),
    ],
)
def test_a_refusal_is_every_choice_aborted_without_output(answer, is_refusal):
    assert drain.refused(answer) is is_refusal
    expected = drain.ABORTED if is_refusal else None
    assert drain.refusal(200, json.dumps(answer).encode()) == expected


# vLLM's answer to a request whose KV load failed under kv_load_failure_policy "fail"
# (test_connector_e2e.FAILED_LOAD_ERROR): HTTP 500, or a stream's only event.
FAILED_LOAD = {
    "error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
              "code": 500}
}  # fmt: skip
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
ENGINE_DEAD = {
    "error": {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError", "code": 500}
}


@pytest.mark.parametrize(
    ("status", "body", "why"),
    [
        (500, json.dumps(ENGINE_DEAD).encode(), drain.ENGINE_GONE),
        (500, b'{"error": {"message": "CUDA out of memory", "code": 500}}', None),
        (503, json.dumps(ENGINE_DEAD).encode(), None),  # not what vLLM answers
        (400, json.dumps(_answer(ABORTED)).encode(), None),
        (200, b"<html>bad gateway</html>", None),  # not JSON: the leg reports it as it is
        (500, b"Internal Server Error", None),
    ],
)
def test_an_exited_engine_is_a_refusal_too(status, body, why):
    assert drain.refusal(status, body) == why


def _sse(*events: Any) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


ROLE_DELTA = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
TOKEN = {"choices": [{"index": 0, "text": " tok", "finish_reason": None}]}
ABORT_DELTA = {"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]}
CONTENT_DELTA = {"choices": [{"index": 0, "delta": {"content": "x"}}]}


@pytest.mark.parametrize(
    ("chunks", "head_chunks"),  # head_chunks: how many chunks the head is; None: a refusal
    [
        ([_sse(b"[DONE]")], None),  # vLLM: no token event at all
        ([_sse({"choices": [ABORTED]}, b"[DONE]")], None),
        ([_sse(ROLE_DELTA), _sse(ABORT_DELTA, b"[DONE]")], None),  # chat
        ([b""], None),  # ended without an event
        ([_sse(TOKEN), _sse(TOKEN, b"[DONE]")], 1),
        ([_sse(ROLE_DELTA), _sse(CONTENT_DELTA), _sse(b"[DONE]")], 2),
        ([_sse(TOKEN)[:9], _sse(TOKEN)[9:], _sse(b"[DONE]")], 2),  # an event in pieces
        ([_sse({"error": {"message": "boom"}})], 1),  # vLLM's own error: passed on
    ],
)
async def test_read_head_reads_a_stream_up_to_its_first_token(chunks, head_chunks):
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
            await asyncio.sleep(0.05)  # each chunk arrives on its own
        return resp

    app = web.Application()
    app.router.add_post("/s", stream)
    client = http1.Client(keepalive_s=4, connect_timeout_s=5, limit_per_host=10)
    async with _serving(app) as url:
        resp = await client.request("POST", url, "/s", headers={}, body=b"", timeout_s=10)
        if head_chunks is None:
            with pytest.raises(drain.BackendDraining, match="shutting down"):
                await drain.read_head(resp, "decode", url)
            assert resp.ended
            return
        head = await drain.read_head(resp, "decode", url)
        assert head == b"".join(chunks[:head_chunks])  # no further than the first token
        assert head + await resp.read() == b"".join(chunks)  # nothing lost or added
        resp.release()
    await client.close()


# ---- the pool: out of rotation until it has restarted -------------------------------------------


def test_a_draining_backend_stays_out_until_it_has_gone_and_come_back():
    now = [100.0]
    pool = BackendPool("prefill", ["http://a:1", "http://b:1"], clock=lambda: now[0])
    a, _ = pool.backends
    assert pool.drain(a, "a is shutting down") is True
    assert pool.drain(a, "a is shutting down") is False  # already out
    assert a.snapshot(now[0])["draining"] and not a.healthy
    assert [pool.pick().url for _ in range(3)] == ["http://b:1"] * 3
    for _ in range(5):  # it still answers /health while it drains: it stays out
        now[0] += 1.0
        assert pool.probe_ok(a) is False and not a.healthy
    assert pool.probe_timed_out(a, "late") is False and a.draining_since_s is not None
    assert pool.probe_failed(a, "connection refused") is False  # it exited
    assert not a.snapshot(now[0])["draining"]
    now[0] += 1.0
    assert pool.probe_ok(a) is True and a.healthy  # its restart
    assert {pool.pick().url for _ in range(2)} == {"http://a:1", "http://b:1"}


def test_a_backend_that_refuses_without_going_away_is_retried_now_and_then():
    now = [0.0]
    pool = BackendPool("decode", ["http://a:1"], clock=lambda: now[0])
    (a,) = pool.backends
    pool.drain(a, "refused")
    now[0] += DRAIN_RECHECK_S - 0.5
    assert pool.probe_ok(a) is False
    pool.drain(a, "refused again")  # a refusal restarts the wait
    now[0] += DRAIN_RECHECK_S - 0.5
    assert pool.probe_ok(a) is False
    now[0] += 1.0
    assert pool.probe_ok(a) is True and a.healthy and a.draining_since_s is None


# ---- the proxy sends the leg elsewhere ----------------------------------------------------------

HANDOFF = {"do_remote_prefill": True, "transfer_id": "t-1", "remote_block_ids": [1, 2]}


@dataclass(eq=False)
class Fake:
    """A vLLM-shaped backend; ``refuses``: answers every generation as a vLLM that is shutting
    down does, while its engine drains (``"abort"``) or once it has exited (``"engine_dead"``)."""

    role: str
    refuses: str | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    # A decode: this many requests carrying a handoff get vLLM's answer to a failed KV load
    # under kv_load_failure_policy "fail" (its prefill is gone).
    failed_loads: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({})  # 200, draining or not: vLLM's /health while it drains

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        stream = body.get("stream")
        if self.refuses == "engine_dead":
            return web.json_response(ENGINE_DEAD, status=500)
        if self.failed_loads and "kv_transfer_params" in body:
            self.failed_loads -= 1
            if stream:
                return web.Response(body=_sse(FAILED_LOAD, b"[DONE]"),
                                    content_type="text/event-stream")  # fmt: skip
            return web.json_response(FAILED_LOAD, status=500)
        if self.refuses == "abort":
            if stream:
                return web.Response(body=_sse(b"[DONE]"), content_type="text/event-stream")
            usage = {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
            return web.json_response({**_answer(ABORTED), "usage": usage})
        if stream:
            return web.Response(body=_sse(TOKEN, TOKEN, b"[DONE]"),
                                content_type="text/event-stream")  # fmt: skip
        answer = _answer({"index": 0, "text": " hello", "finish_reason": "length"})
        if self.role == "prefill":
            answer["kv_transfer_params"] = HANDOFF
        return web.json_response(answer)


class _serving:
    """``async with _serving(app) as url``: an aiohttp app on a free loopback port."""

    def __init__(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)

    async def __aenter__(self) -> str:
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


async def _complete(http: aiohttp.ClientSession, url: str, stream: bool) -> str:
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream}
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.text()


@pytest.mark.parametrize("refuses", ["abort", "engine_dead"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_draining_backend_is_taken_out_at_once_and_no_request_fails(role, refuses):
    fakes = {r: [Fake(r, refuses if r == role else None), Fake(r)] for r in ("prefill", "decode")}
    async with contextlib.AsyncExitStack() as stack:
        urls = {r: [await stack.enter_async_context(_serving(f.app())) for f in fakes[r]]
                for r in fakes}  # fmt: skip
        start_proxy = await stack.enter_async_context(proxies())
        proxy = await start_proxy(
            prefill=urls["prefill"], decode=urls["decode"], health_interval_s=0.2
        )
        async with aiohttp.ClientSession() as http:
            answers = [await _complete(http, proxy, stream=i % 2 == 1) for i in range(8)]
            async with http.get(proxy + "/health") as resp:
                health = await resp.json()
            async with http.get(proxy + "/metrics") as resp:
                metrics = await resp.text()
            await asyncio.sleep(1.0)  # five probe rounds: /health says 200 all along
            async with http.get(proxy + "/health") as resp:
                later = await resp.json()
    draining, other = fakes[role]
    assert all("hello" in a or "tok" in a for a in answers)
    assert len(draining.seen) == 1, "the draining backend got a request after it refused one"
    assert len(other.seen) == 8
    if role == "decode":  # the decode leg went elsewhere with the handoff nobody had used
        assert draining.seen[0]["kv_transfer_params"] == other.seen[0]["kv_transfer_params"]
    for report in (health, later):
        state = {b["url"]: (b["healthy"], b["draining"]) for b in report[role]}
        assert state == {urls[role][0]: (False, True), urls[role][1]: (True, False)}
    refusals = {
        (s.labels["role"], s.labels["backend"], s.labels["kind"]): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "mooncake_proxy_backend_errors_total"
    }
    assert refusals == {(role, urls[role][0], "draining"): 1.0}


async def _metric(http: aiohttp.ClientSession, proxy: str, name: str, **labels: str) -> float:
    async with http.get(proxy + "/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.parametrize("dispatch", ["sequential", "concurrent"])
@pytest.mark.parametrize("refuses", ["abort", "engine_dead"])
async def test_with_its_only_prefill_draining_the_decode_computes_the_prompt(
    refuses, dispatch, caplog
):
    """One prefill, shutting down: its refusal takes it out, and every request, streamed or not,
    goes to the decode as a plain request (no handoff), counted once each as local and logged
    once for the episode; the first answer of a prefill back in rotation ends the episode."""
    prefill, decode = Fake("prefill", refuses), Fake("decode")
    async with contextlib.AsyncExitStack() as stack:
        p_url = await stack.enter_async_context(_serving(prefill.app()))
        d_url = await stack.enter_async_context(_serving(decode.app()))
        start_proxy = await stack.enter_async_context(proxies())
        proxy = await start_proxy(
            prefill=[p_url], decode=[d_url], health_interval_s=0.2, dispatch=dispatch
        )
        async with aiohttp.ClientSession() as http:
            answers = [await _complete(http, proxy, stream=i % 2 == 1) for i in range(6)]
            local = await _metric(http, proxy, "mooncake_proxy_dispatched_total", how="local")
    assert all("hello" in a or "tok" in a for a in answers)
    assert len(prefill.seen) == 1, "the draining prefill got a request after it refused one"
    assert len(decode.seen) == 6
    assert all("kv_transfer_params" not in body for body in decode.seen)
    assert all(body["max_tokens"] == 4 for body in decode.seen)  # the client's, not the leg's
    assert local == 6
    episodes = [r for r in caplog.records if "no prefill can take requests" in r.getMessage()]
    assert len(episodes) == 1


async def test_local_episodes_are_logged_once_each_and_end_with_a_prefill_answer(caplog):
    backends = _backends()
    ctx = _ctx()
    for _ in range(3):
        backends.served_locally(ctx, "no healthy prefill backend (1 configured)")
    backends.prefill_served("http://p:1")
    backends.prefill_served("http://p:1")  # no episode running: nothing logged
    backends.served_locally(ctx, "no healthy prefill backend (1 configured)")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no prefill can take requests" in m for m in messages) == 2
    assert [m for m in messages if "serves again" in m] == [
        "prefill http://p:1 serves again: 3 requests were computed by decodes meanwhile"
    ]


@pytest.mark.parametrize("dispatch", ["sequential", "concurrent"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_load_before_a_token_is_sent_again(stream, dispatch):
    """The decode's load failed (policy "fail": the prefill that held the KV went away): the
    client never sees it; both legs go again, up to ``MAX_RELOADS`` times, and the answer is the
    decode's that loaded."""
    prefill, decode = Fake("prefill"), Fake("decode", failed_loads=1)
    async with contextlib.AsyncExitStack() as stack:
        p_url = await stack.enter_async_context(_serving(prefill.app()))
        d_url = await stack.enter_async_context(_serving(decode.app()))
        start_proxy = await stack.enter_async_context(proxies())
        proxy = await start_proxy(prefill=[p_url], decode=[d_url], dispatch=dispatch)
        async with aiohttp.ClientSession() as http:
            answer = await _complete(http, proxy, stream=stream)
            reloaded = await _metric(http, proxy, "mooncake_proxy_dispatched_total", how="reloaded")
            # One failure more than the proxy re-sends: the last reaches the client as vLLM
            # answered it.
            decode.failed_loads = MAX_RELOADS + 1
            body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream}
            async with http.post(proxy + "/v1/completions", json=body) as resp:
                status, text = resp.status, await resp.text()
            total = await _metric(http, proxy, "mooncake_proxy_dispatched_total", how="reloaded")
    assert "hello" in answer or "tok" in answer
    assert reloaded == 1
    assert total - reloaded == MAX_RELOADS
    assert decode.failed_loads == 0  # every failure was met by a re-send but the last
    assert len(prefill.seen) >= 2 and len(decode.seen) >= 2
    assert "Internal server error" in text
    assert status == (200 if stream else 500)


# ---- calls waiting on a backend that has left ---------------------------------------------------


async def _until(check, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.01)


def _backends() -> Backends:
    cfg = ProxyConfig(prefill=["http://p:1"], decode=["http://a:1", "http://b:1"])
    return Backends(cfg, ProxyMetrics())


def _ctx() -> RequestContext:
    return RequestContext("r-1", time.monotonic(), "/v1/completions", {}, {})


async def test_a_call_waiting_on_a_backend_that_left_goes_to_another_one():
    backends = _backends()
    a, b = backends.pools["decode"].backends
    sent: list[str] = []

    async def send(backend, deadline) -> str:
        sent.append(backend.url)
        if backend is a:
            await asyncio.Event().wait()  # a stopped vLLM's API server that never answers
        return f"answer from {backend.url}"

    # Not repeatable, as a decode leg: retried all the same, a has not acted on it.
    call = asyncio.create_task(backends.call("decode", _ctx(), send, repeatable=False))
    await _until(lambda: sent == [a.url])
    backends.pools["decode"].remove(a.url)
    assert backends.abandon(a) == 1
    attempt = await call
    assert attempt.answer == f"answer from {b.url}" and attempt.backend is b
    assert sent == [a.url, b.url]
    assert backends.abandon(a) == 0  # nothing left waiting on it


async def test_a_cancelled_caller_is_not_retried_and_its_call_is_cancelled_with_it():
    backends = _backends()
    a, _ = backends.pools["decode"].backends
    sent: list[str] = []
    cancelled: list[str] = []

    async def send(backend, deadline) -> str:
        sent.append(backend.url)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(backend.url)  # where a decode leg closes its response
            raise
        return "an open response"

    call = asyncio.create_task(backends.call("decode", _ctx(), send, repeatable=False))
    await _until(lambda: sent == [a.url])
    call.cancel()  # the client goes away
    with pytest.raises(asyncio.CancelledError):
        await call
    assert sent == [a.url] and cancelled == [a.url]
    assert a.in_flight == 0
    assert backends.abandon(a) == 0


async def test_an_answer_that_arrived_is_the_callers_even_if_it_is_cancelled_next():
    backends = _backends()
    answer_now = asyncio.Event()

    async def send(backend, deadline) -> str:
        await answer_now.wait()
        return "an open response"

    call = asyncio.create_task(backends.call("decode", _ctx(), send, repeatable=False))
    await asyncio.sleep(0)
    answer_now.set()
    await asyncio.sleep(0)  # the answer has arrived: the call returns it in the same step
    call.cancel()  # too late to drop it: the caller owns the answer and closes it
    assert (await call).answer == "an open response"


async def test_legs_waiting_on_a_backend_that_stopped_listening_go_to_another_one(caplog):
    """vLLM 0.32 stops listening only after its engine client has stopped, and a leg it accepted
    just before then is never answered (``drain.py``). Static backends, no discovery: once a
    health probe finds nothing listening, the legs still waiting there go to the other prefill,
    long before the prefill leg's deadline (120 s by default)."""
    hung = asyncio.Event()
    stuck, other, decode = Fake("prefill"), Fake("prefill"), Fake("decode")

    async def never(request: web.Request) -> web.Response:
        stuck.seen.append(await request.json())
        hung.set()
        await asyncio.Event().wait()  # the engine is gone: no answer, the connection stays open
        raise AssertionError("unreachable")

    stuck_app = web.Application()
    stuck_app.router.add_post("/v1/completions", never)
    stuck_app.router.add_get("/health", stuck._health)
    runner = web.AppRunner(stuck_app, shutdown_timeout=0.5)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    stuck_url = f"http://127.0.0.1:{port}"
    try:
        async with contextlib.AsyncExitStack() as stack:
            other_url = await stack.enter_async_context(_serving(other.app()))
            d_url = await stack.enter_async_context(_serving(decode.app()))
            start_proxy = await stack.enter_async_context(proxies())
            proxy = await start_proxy(
                prefill=[stuck_url, other_url], decode=[d_url], health_interval_s=0.2
            )
            async with aiohttp.ClientSession() as http:
                calls = [
                    asyncio.create_task(_complete(http, proxy, stream=i % 2 == 1)) for i in range(4)
                ]
                await asyncio.wait_for(hung.wait(), 10)
                await asyncio.sleep(0.5)  # the others are answered; stuck's legs wait
                assert not all(c.done() for c in calls)
                await site.stop()  # the listener closes; the accepted connections stay open
                answers = await asyncio.wait_for(asyncio.gather(*calls), 10)
    finally:
        await runner.cleanup()
    assert all("hello" in a or "tok" in a for a in answers)
    assert len(other.seen) == 4, "every leg stuck on the stopped prefill went to the other one"
    assert [r for r in caplog.records if "no longer listens" in r.getMessage()]
