"""The proxy's ``--dispatch concurrent`` on the shared cluster's real pair: the decode request
leaves with the prefill request, waits for the KV without stepping, and is token-exact against
the plain vLLM; a failure of either leg ends the other, and no block stays held. The pair's
prefill has ``layerwise_handoff``: decodes read layers while their prefill computes.

No vLLM of its own: the cluster's prefill, decode (policy recompute) and kv_both instance (policy
fail), and proxies served in the test's event loop.
"""

from __future__ import annotations

import asyncio
import random
import secrets

import pytest

from harness.pd import (
    PULL_COUNTERS,
    complete,
    eventually,
    greedy_body,
    pulls_since,
    tokens_by_transfer,
    two_legs,
)
from mooncake_vllm.proxy.producers import producer_of
from tests.test_proxy_faults import metric_value

pytestmark = pytest.mark.servers

MAX_TOKENS = 8


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


def nothing_held(srv) -> bool:
    return (
        srv.metric("mooncake_vllm:held_leases") == 0
        and srv.metric("vllm:kv_cache_usage_perc") == pytest.approx(0.0, abs=1e-9)
        and srv.metric("vllm:num_requests_running") == 0
        and srv.metric("vllm:num_requests_waiting") == 0
    )


async def concurrent_proxy(http, start_proxy, pd, **config) -> str:
    """A --dispatch concurrent proxy that has learnt where the prefill is (its first request
    goes sequentially)."""
    proxy = await start_proxy(
        prefill=[pd.prefill.url], decode=[pd.decode.url], dispatch="concurrent", **config
    )
    await complete(http, proxy, greedy_body(pd.model, [5, 6, 7], 2))
    return proxy


async def busy_prefill(http, pd, n: int = 6) -> list[asyncio.Task]:
    """Queues ``n`` long prompts straight at the prefill (about 1 s of work here for six), and
    returns once they are all there, so that the next one waits behind them."""
    bodies = [greedy_body(pd.model, p, 1) for p in prompts(secrets.randbits(32), [1500] * n)]
    tasks = [asyncio.create_task(complete(http, pd.prefill, b)) for b in bodies]

    def arrived() -> int:
        at_prefill = sum(
            pd.prefill.metric(f"vllm:num_requests_{s}") for s in ("running", "waiting")
        )
        return at_prefill + sum(t.done() for t in tasks)

    await eventually(lambda: arrived() >= n, 10, f"{n} prompts at the prefill")
    return tasks


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_concurrent_dispatch_is_token_exact_and_every_prompt_arrives_by_transfer(
    pd, http, start_proxy, stream
):
    proxy = await concurrent_proxy(http, start_proxy, pd)
    batch = prompts(71 + stream, [1, 127, 128, 129, 300, 640, 1000, 1500])
    before = tokens_by_transfer(pd.decode)
    pulls = pd.decode.metric("mooncake_vllm:pulls_total")
    cancelled = pd.decode.metric("mooncake_vllm:cancelled_total")
    sem = asyncio.Semaphore(4)

    async def one(prompt):
        async with sem:
            body = greedy_body(pd.model, prompt, MAX_TOKENS, stream=stream)
            got = await complete(http, proxy, body)
            want = await complete(http, pd.plain, {**body, "stream": False})
            return got.token_ids == want.token_ids

    assert all(await asyncio.gather(*(one(p) for p in batch)))
    # The prompts came by transfer (vLLM may count each one's last token as computed), one pull
    # of each.
    await eventually(
        lambda: pd.decode.metric("mooncake_vllm:pulls_total") - pulls == len(batch), 10, "pulls"
    )
    total = sum(len(p) for p in batch)
    assert total - len(batch) <= tokens_by_transfer(pd.decode) - before <= total
    assert pd.decode.metric("mooncake_vllm:cancelled_total") == cancelled
    async with http.get(proxy + "/metrics") as resp:
        text = await resp.text()
    assert f'mooncake_proxy_dispatched_total{{how="concurrent"}} {len(batch)}.0' in text
    await eventually(lambda: nothing_held(pd.prefill) and nothing_held(pd.decode), 10, "freed")


async def test_past_the_expected_wait_a_burst_goes_sequentially_and_every_request_is_served(
    pd, http, start_proxy
):
    """``--concurrent-max-wait-s``: once the prompts in flight at the prefill are expected to
    take longer than it (here 0.5 s; the proxy learnt a time per byte from its first, 3-token
    request), the decode legs of the rest wait for the prefill's answer; all are token-exact
    and pulled."""
    proxy = await concurrent_proxy(http, start_proxy, pd, concurrent_max_wait_s=0.5)
    batch = prompts(76, [1500] * 6)
    pulls = pd.decode.metric("mooncake_vllm:pulls_total")
    failures = pd.decode.metric("mooncake_vllm:pull_failures_total")
    bodies = [greedy_body(pd.model, p, MAX_TOKENS) for p in batch]
    got = await asyncio.gather(*(complete(http, proxy, b) for b in bodies))  # all at once
    for answer, body in zip(got, bodies, strict=True):
        assert answer.token_ids == (await complete(http, pd.plain, body)).token_ids
    await eventually(
        lambda: pd.decode.metric("mooncake_vllm:pulls_total") - pulls == len(batch), 10, "pulls"
    )
    assert pd.decode.metric("mooncake_vllm:pull_failures_total") == failures
    how = {
        h: await metric_value(http, proxy, f'mooncake_proxy_dispatched_total{{how="{h}"}}')
        for h in ("concurrent", "queued")
    }
    assert how["queued"] >= 1 and how["concurrent"] + how["queued"] == len(batch), how
    print(f"dispatched: {how}")
    await eventually(lambda: nothing_held(pd.prefill) and nothing_held(pd.decode), 10, "freed")


async def test_a_prefill_that_fails_cancels_the_waiting_decode_and_frees_its_blocks(
    pd, http, start_proxy
):
    # The prefill leg misses its deadline (504) while the decode waits for its KV: its prompt
    # alone takes about 0.15 s here, the queue ahead of it about 1 s.
    proxy = await concurrent_proxy(http, start_proxy, pd, prefill_timeout_s=0.25)
    cancelled = pd.decode.metric("mooncake_vllm:cancelled_total")
    queued = await busy_prefill(http, pd)
    body = greedy_body(pd.model, prompts(72, [1000])[0], MAX_TOKENS)
    async with http.post(proxy + "/v1/completions", json=body) as resp:
        assert resp.status == 504, await resp.text()
    took = await eventually(
        lambda: (
            pd.decode.metric("mooncake_vllm:cancelled_total") == cancelled + 1
            and nothing_held(pd.decode)
        ),
        1.0,
        "the decode's request cancelled and its blocks freed",
    )
    print(f"decode cancelled and freed {took:.2f} s after the prefill's 504")
    await asyncio.gather(*queued)
    await eventually(lambda: nothing_held(pd.prefill), 10, "the prefill freed")


async def test_a_decode_that_cannot_take_the_request_cancels_the_prefill(pd, http, start_proxy):
    proxy = await concurrent_proxy(http, start_proxy, pd)
    expired = pd.prefill.metric("mooncake_vllm:expired_total")
    queued = await busy_prefill(http, pd)
    # min_tokens over max_tokens: the decode refuses it (400) while the prefill, whose leg
    # drops min_tokens, still queues. Sequentially the prefill would compute it and hold its
    # blocks for a decode that never comes, until the lease's TTL.
    body = greedy_body(pd.model, prompts(73, [1000])[0], 4, min_tokens=8)
    async with http.post(proxy + "/v1/completions", json=body) as resp:
        assert resp.status == 400, await resp.text()
    await asyncio.gather(*queued)
    await eventually(lambda: nothing_held(pd.prefill), pd.lease_ttl_s / 2, "the prefill freed")
    assert pd.prefill.metric("mooncake_vllm:expired_total") == expired


async def test_a_client_that_goes_away_cancels_both_legs(pd, http, start_proxy):
    proxy = await concurrent_proxy(http, start_proxy, pd)
    cancelled = pd.decode.metric("mooncake_vllm:cancelled_total")
    queued = await busy_prefill(http, pd)
    body = greedy_body(pd.model, prompts(74, [1200])[0], MAX_TOKENS, stream=True)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(complete(http, proxy, body), 0.3)
    await eventually(
        lambda: (
            pd.decode.metric("mooncake_vllm:cancelled_total") == cancelled + 1
            and nothing_held(pd.decode)
        ),
        2.0,
        "the decode's request cancelled and its blocks freed",
    )
    await asyncio.gather(*queued)
    await eventually(lambda: nothing_held(pd.prefill), 10, "the prefill freed")


async def test_a_decode_waiting_before_its_prefill_reads_the_layers_as_they_are_written(pd, http):
    """The legs by hand, the decode's first: its acquire waits at the prefill before the prompt
    is scheduled, so with the prefill's ``layerwise_handoff`` (a prompt alone in its step) it is
    granted in that step and reads layers while the rest are computed; token-exact, one pull."""
    body = greedy_body(pd.model, prompts(81, [1500])[0], MAX_TOKENS)
    head, _ = await two_legs(http, pd.prefill, pd.decode, greedy_body(pd.model, [5, 6, 7], 2))
    where = producer_of(head.kv_transfer_params)  # what the proxy puts in a pending handoff
    tid = secrets.token_hex(16)
    pending = {"do_remote_prefill": True, "pending": True, "transfer_id": tid, **where}
    before = PULL_COUNTERS.read(pd.decode)
    layered = pd.decode.metric("mooncake_vllm:layered_total")
    decode = asyncio.create_task(complete(http, pd.decode, {**body, "kv_transfer_params": pending}))
    await eventually(lambda: pd.decode.metric("vllm:num_requests_waiting") == 1, 10, "parked")
    prefill_leg = {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "transfer_id": tid}}  # fmt: skip
    assert (await complete(http, pd.prefill, prefill_leg)).kv_transfer_params["transfer_id"] == tid
    assert (await decode).token_ids == (await complete(http, pd.plain, body)).token_ids
    moved = await pulls_since(pd.decode, before, 1)
    assert (moved["pulls"], moved["pull_failures"]) == (1, 0)
    assert pd.decode.metric("mooncake_vllm:layered_total") == layered + 1
    await eventually(lambda: nothing_held(pd.prefill) and nothing_held(pd.decode), 10, "freed")


@pytest.mark.provokes_pull_failure
async def test_a_pending_handoff_no_prefill_ever_holds_fails_per_policy_at_the_deadline(pd, http):
    # The decode's view of a prefill killed after both legs left: nothing ever holds the id.
    # kv_both fails such a request (policy fail) once its load_timeout_s has passed.
    pending = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "pending": True,
        "transfer_id": secrets.token_hex(16),
        "producer_engine_id": "gone",
        "side_channel_host": "127.0.0.4",
        "side_channel_ports": [13021],  # kv_both's own side channel: it never holds this id
        "producer_tp_size": 1,
    }
    failures = pd.both.metric("mooncake_vllm:pull_failures_total")
    body = greedy_body(pd.model, prompts(75, [300])[0], 4, kv_transfer_params=pending)
    t0 = asyncio.get_running_loop().time()
    async with http.post(pd.both.url + "/v1/completions", json=body) as resp:
        assert resp.status == 500, await resp.text()
    took = asyncio.get_running_loop().time() - t0
    assert pd.load_timeout_s - 1 <= took < pd.load_timeout_s + 5  # ends at the load deadline
    assert pd.both.metric("mooncake_vllm:pull_failures_total") == failures + 1
    await eventually(lambda: nothing_held(pd.both), 10, "kv_both freed")
