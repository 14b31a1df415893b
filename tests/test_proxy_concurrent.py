"""``--dispatch concurrent`` against fake vLLM servers: the decode leg leaves with the prefill leg
(a pending handoff naming the prefill's side channel, learnt from its earlier handoffs), and a
failure of either leg ends the other. The real pair: ``test_connector_e2e``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from tests.test_proxy_faults import (  # noqa: F401
    FakeVllm,
    Seen,
    client,
    eventually,
    metric_value,
)

PRODUCER = {
    "producer_engine_id": "prefill-0",
    "side_channel_host": "127.0.0.2",
    "side_channel_ports": [14001],
    "producer_tp_size": 1,
}
HANDOFF = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "transfer_id": "0" * 32,
    "remote_block_ids": [3, 4],
    "prompt_len": 200,
    "block_size": 128,
    "compat_hash": "c" * 64,
    **PRODUCER,
}
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


@dataclass(eq=False)
class GatedPrefill(FakeVllm):
    """A prefill that answers a generation only once ``gate`` is set (it is computing)."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, body, request.headers.copy()))
        await self.gate.wait()
        if self.status != 200:
            return web.Response(status=self.status, body=self.error_body)
        return web.json_response({**self.answer(), "kv_transfer_params": self.handoff})


@pytest.fixture
async def backends(start_fake):
    prefill = await start_fake(GatedPrefill, "prefill", handoff=HANDOFF)
    decode = await start_fake(FakeVllm, "decode")
    return prefill, decode


async def learnt_proxy(
    start_proxy,
    client,  # noqa: F811
    prefill: GatedPrefill,
    decode: FakeVllm,
    **config,
) -> str:
    """A concurrent proxy after its first request, which went sequentially and taught it where
    the prefill is; the prefill computes (holds its answers) again."""
    proxy = await start_proxy(
        prefill=[prefill.url], decode=[decode.url], dispatch="concurrent", **config
    )
    prefill.gate.set()
    async with client.post(proxy + "/v1/completions", json=BODY) as resp:
        assert resp.status == 200, await resp.text()
    prefill.gate.clear()
    return proxy


async def in_flight(client, proxy: str, role: str, url: str) -> float | None:  # noqa: F811
    return await metric_value(
        client, proxy, f'mooncake_proxy_backend_in_flight{{backend="{url}",role="{role}"}}'
    )


async def test_the_decode_leg_leaves_with_the_prefill_leg_once_the_prefill_is_known(
    backends,
    start_proxy,
    client,  # noqa: F811
):
    prefill, decode = backends
    proxy = await learnt_proxy(start_proxy, client, prefill, decode)
    # The first request to a prefill went sequentially: its handoff says where the prefill is.
    assert decode.generation_requests()[0].body["kv_transfer_params"] == HANDOFF
    answer = asyncio.create_task(client.post(proxy + "/v1/completions", json=BODY))
    await eventually(lambda: _true(len(decode.generation_requests()) == 2))
    assert not prefill.gate.is_set()  # the decode leg is out while the prefill computes
    sent = prefill.generation_requests()[1].body["kv_transfer_params"]
    pending = decode.generation_requests()[1].body["kv_transfer_params"]
    assert pending == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pending": True,
        "transfer_id": sent["transfer_id"],
        **PRODUCER,
    }
    prefill.gate.set()
    async with await answer as resp:
        assert resp.status == 200 and await resp.json() == FakeVllm.answer()
    assert len(decode.generation_requests()) == 2  # one decode leg per request
    for how, n in (("sequential", 1), ("concurrent", 1), ("resent", 0)):
        assert (
            await metric_value(client, proxy, f'mooncake_proxy_dispatched_total{{how="{how}"}}')
            == n
        )


async def test_a_prefill_expected_to_answer_late_gets_the_decode_leg_after_its_answer(
    backends,
    start_proxy,
    client,  # noqa: F811
):
    """A deep prefill queue: the decode would wait past ``--concurrent-max-wait-s`` for its KV,
    holding its blocks and running toward its load deadline, so it is sent sequentially."""
    prefill, decode = backends
    # Any prefill time exceeds this: the learning request's answer took more than a microsecond.
    proxy = await learnt_proxy(start_proxy, client, prefill, decode, concurrent_max_wait_s=1e-6)
    answer = asyncio.create_task(client.post(proxy + "/v1/completions", json=BODY))
    await eventually(lambda: _true(len(prefill.generation_requests()) == 2))
    await asyncio.sleep(0.2)
    assert len(decode.generation_requests()) == 1  # nothing sent while the prefill computes
    prefill.gate.set()
    async with await answer as resp:
        assert resp.status == 200 and await resp.json() == FakeVllm.answer()
    # The real handoff, not a pending one.
    assert decode.generation_requests()[1].body["kv_transfer_params"] == HANDOFF
    for how, n in (("sequential", 1), ("queued", 1), ("concurrent", 0), ("resent", 0)):
        assert (
            await metric_value(client, proxy, f'mooncake_proxy_dispatched_total{{how="{how}"}}')
            == n
        )


async def test_a_failed_prefill_cancels_the_waiting_decode_leg(
    backends,
    start_proxy,
    client,  # noqa: F811
):
    prefill, decode = backends
    proxy = await learnt_proxy(start_proxy, client, prefill, decode)
    decode.hang = True  # it waits for the KV
    prefill.status = 500
    answer = asyncio.create_task(client.post(proxy + "/v1/completions", json=BODY))
    await eventually(lambda: _true(len(decode.generation_requests()) == 2))
    assert await in_flight(client, proxy, "decode", decode.url) == 1
    prefill.gate.set()
    async with await answer as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == "prompt too long"  # the prefill's
    # The decode leg's connection is closed (vLLM aborts the request, its wait is withdrawn).
    await eventually(lambda: _equal(in_flight(client, proxy, "decode", decode.url), 0), timeout_s=2)


async def test_a_decode_that_fails_first_cancels_the_prefill_leg(
    backends,
    start_proxy,
    client,  # noqa: F811
):
    prefill, decode = backends
    proxy = await learnt_proxy(start_proxy, client, prefill, decode)
    decode.status = 400  # e.g. the prompt does not fit: it cannot admit the request
    async with client.post(proxy + "/v1/completions", json=BODY) as resp:
        assert resp.status == 400  # at once: the prefill is still computing
        assert not prefill.gate.is_set()
    await eventually(
        lambda: _equal(in_flight(client, proxy, "prefill", prefill.url), 0), timeout_s=2
    )


async def test_a_prefill_that_hands_over_from_another_producer_gets_the_decode_leg_again(
    backends,
    start_proxy,
    client,  # noqa: F811
):
    prefill, decode = backends
    proxy = await learnt_proxy(start_proxy, client, prefill, decode)
    prefill.gate.set()
    restarted = {**HANDOFF, "side_channel_ports": [14011]}  # restarted on other ports
    prefill.handoff = restarted
    async with client.post(proxy + "/v1/completions", json=BODY) as resp:
        assert resp.status == 200
    _, pending, again = (s.body["kv_transfer_params"] for s in decode.generation_requests())
    assert pending["pending"] and pending["side_channel_ports"] == [14001]
    assert again == restarted
    async with client.post(proxy + "/v1/completions", json=BODY) as resp:
        assert resp.status == 200  # learnt: the next one waits on the new ports
    assert decode.generation_requests()[-1].body["kv_transfer_params"]["side_channel_ports"] == [
        14011
    ]


async def test_a_client_that_goes_away_cancels_both_legs(
    backends,
    start_proxy,
    client,  # noqa: F811
):
    prefill, decode = backends
    proxy = await learnt_proxy(start_proxy, client, prefill, decode)
    decode.hang = True
    answer = asyncio.create_task(client.post(proxy + "/v1/completions", json=BODY))
    await eventually(lambda: _true(len(decode.generation_requests()) == 2))
    assert await in_flight(client, proxy, "prefill", prefill.url) == 1
    answer.cancel()  # the client closes its connection
    for role, url in (("prefill", prefill.url), ("decode", decode.url)):
        await eventually(lambda r=role, u=url: _equal(in_flight(client, proxy, r, u), 0), 2)


async def test_pool_mode_refuses_concurrent_dispatch():
    from pydantic import ValidationError

    from mooncake_vllm.proxy.config import ProxyConfig

    with pytest.raises(ValidationError, match="--dispatch concurrent needs --mode p2p"):
        ProxyConfig(
            prefill=["http://a:1"], decode=["http://b:1"], mode="pool", dispatch="concurrent"
        )


async def _true(value: bool) -> bool:
    return value


async def _equal(value, expected) -> bool:
    return (await value) == expected
