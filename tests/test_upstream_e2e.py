"""vLLM's upstream MooncakeConnector protocol on the shared cluster's real pair: the bootstrap
``/query`` and the two legs sent at once, as vLLM's mooncake proxy and llm-d send them
(``harness.upstream_clients``), token-exact against the plain vLLM, every prompt by transfer, no
pull failure, nothing held afterwards; and what happens when a leg or the bootstrap fails.

No vLLM of its own: the cluster's prefill (bootstrap on 127.0.0.2:8998, the default), its decode
(policy recompute) and the plain reference.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import pytest

from harness.pd import PULL_COUNTERS, complete, eventually, greedy_body, tokens_by_transfer
from harness.upstream_clients import LlmdMooncake, VllmMooncakeProxy
from tests.test_concurrent_e2e import nothing_held

pytestmark = pytest.mark.servers

MAX_TOKENS = 8
BOOTSTRAP = "http://127.0.0.2:8998"


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


async def read_answer(resp, chat: bool) -> tuple[list[int], str]:
    """Token ids (completions) and text of a response, streamed or not; releases it."""
    ids, text = [], []
    async with resp:
        if resp.content_type == "application/json":
            events = [await resp.json()]
        else:
            events = []
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    events.append(json.loads(line[5:]))
    for event in events:
        assert "error" not in event, event
        for choice in event.get("choices", []):
            ids.extend(choice.get("token_ids") or [])
            if chat:
                part = choice.get("message") or choice.get("delta") or {}
                text.append(part.get("content") or "")
            else:
                text.append(choice.get("text") or "")
    return ids, "".join(text)


def chat_body(model: str, words: str, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": words}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}  # fmt: skip


async def plain_answer(http, pd, api: str, body: dict) -> tuple[list[int], str]:
    resp = await http.post(pd.plain.url + api, json={**body, "stream": False})
    return await read_answer(resp, chat="chat" in api)


async def test_the_bootstrap_answers_query_in_upstreams_shape(pd, http):
    async with http.get(f"{BOOTSTRAP}/query") as resp:
        assert resp.status == 200
        data = await resp.json()
    ((rank, entry),) = data.items()
    assert rank == "0" and isinstance(entry["engine_id"], str)
    assert entry["worker_addr"] == {"0": {"0": "tcp://127.0.0.2:13004"}}  # our side channel
    async with http.post(f"{BOOTSTRAP}/register", json={}) as resp:
        assert resp.status == 403  # nobody registers workers here


@pytest.mark.parametrize("flow", ["vllm-proxy", "llm-d"])
async def test_an_upstream_orchestrators_flow_is_token_exact_and_pulled(pd, http, flow):
    """Completions and chat, streamed and not, at concurrency 8: every answer equal to the plain
    vLLM's, every prompt by transfer, no pull failed (the ``pd`` fixture), nothing held."""
    if flow == "vllm-proxy":
        client = VllmMooncakeProxy(http, [(pd.prefill.url, None)], [pd.decode.url])
        await client.start()

        def post(api, body):
            return client.post(api, body)
    else:
        client = LlmdMooncake(http, pd.decode.url)

        def post(api, body):
            return client.post(pd.prefill.url, api, body)

    batch = prompts(37 if flow == "llm-d" else 41, [1, 127, 128, 129, 300, 640, 1000, 1500] * 2)
    jobs = [
        ("/v1/completions", greedy_body(pd.model, p, MAX_TOKENS, stream=i % 2 == 1,
                                        return_token_ids=True))
        for i, p in enumerate(batch)
    ] + [
        ("/v1/chat/completions", chat_body(pd.model, f"say {w} things", stream=w % 2 == 1))
        for w in range(4)
    ]  # fmt: skip
    before_tokens, before = tokens_by_transfer(pd.decode), PULL_COUNTERS.read(pd.decode)
    sem = asyncio.Semaphore(8)

    async def one(api, body):
        async with sem:
            got = await read_answer(await post(api, body), chat="chat" in api)
        want = await plain_answer(http, pd, api, body)
        return got == want

    assert all(await asyncio.gather(*(one(a, b) for a, b in jobs)))
    await asyncio.gather(*client.prefill_tasks)
    await eventually(
        lambda: PULL_COUNTERS.since(pd.decode, before)["pulls"] >= len(jobs), 10, "pulls"
    )
    assert PULL_COUNTERS.since(pd.decode, before)["pull_failures"] == 0
    total = sum(len(p) for p in batch)
    by_transfer = tokens_by_transfer(pd.decode) - before_tokens
    # vLLM may count each prompt's last token as computed; the chats' prompts come on top.
    assert by_transfer >= 0.99 * (total - len(batch))
    await eventually(lambda: nothing_held(pd.prefill) and nothing_held(pd.decode), 15, "freed")


def decode_leg(model, prompt, transfer_id: str, engine_id: str, bootstrap=BOOTSTRAP) -> dict:
    params = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id}
    params |= {"remote_bootstrap_addr": bootstrap, "remote_engine_id": engine_id}
    return greedy_body(model, prompt, MAX_TOKENS, kv_transfer_params=params)


async def engine_id(http) -> str:
    async with http.get(f"{BOOTSTRAP}/query") as resp:
        return (await resp.json())["0"]["engine_id"]


@pytest.mark.provokes_pull_failure
@pytest.mark.parametrize("case", ["no prefill leg", "unknown engine", "no bootstrap"])
async def test_a_decode_whose_producer_never_answers_ends_per_policy(pd, http, case):
    """The prefill leg never comes, the engine id is not the bootstrap's, or nothing listens at
    the bootstrap: the decode (policy recompute) computes the prompt itself within
    load_timeout_s, token-exact, and frees its blocks."""
    prompt = prompts(hash(case) % 1000, [300])[0]
    eid = await engine_id(http)
    params = {"no prefill leg": (eid, BOOTSTRAP), "unknown engine": ("gone", BOOTSTRAP),
              "no bootstrap": (eid, "http://127.0.0.2:8997")}[case]  # fmt: skip
    before = PULL_COUNTERS.read(pd.decode)
    t0 = time.monotonic()
    body = decode_leg(pd.model, prompt, f"xfer-{uuid.uuid4()}", *params)
    got = await complete(http, pd.decode, body)
    took = time.monotonic() - t0
    want = await complete(http, pd.plain, greedy_body(pd.model, prompt, MAX_TOKENS))
    assert got.token_ids == want.token_ids
    assert took < pd.load_timeout_s + 5
    if case != "no prefill leg":
        assert took < 5  # named at once, not at the deadline
    await eventually(lambda: PULL_COUNTERS.since(pd.decode, before)["pull_failures"] == 1, 10)
    await eventually(lambda: nothing_held(pd.decode), 10, "decode freed")


def prefill_leg(model, prompt, transfer_id: str) -> dict:
    leg = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    return greedy_body(model, prompt, 1, kv_transfer_params=leg)


def logged(srv, text: str) -> bool:
    return text in srv.process.log_tail(200_000)


@pytest.mark.provokes_pull_failure
async def test_a_transfer_id_used_again_after_it_ended_is_refused_on_both_halves(pd, http):
    """The producer refuses an id it has used and holds nothing under it; the decode, which
    pulled under it, refuses another request that carries it (naming it): vLLM's policy
    (recompute here) decides, and the answer is the plain vLLM's."""
    prompt = prompts(5, [300])[0]
    tid, eid = f"xfer-{uuid.uuid4()}", await engine_id(http)
    first = await complete(http, pd.prefill, prefill_leg(pd.model, prompt, tid))
    assert first.kv_transfer_params["transfer_id"] == tid
    assert first.kv_transfer_params["remote_engine_id"] == eid
    await complete(http, pd.decode, decode_leg(pd.model, prompt, tid, eid))
    again = await complete(http, pd.prefill, prefill_leg(pd.model, prompt, tid))
    assert again.kv_transfer_params is None  # refused: nothing held under a used id
    assert logged(pd.prefill, f"transfer_id {tid[:13]} was used before on this producer")
    before = PULL_COUNTERS.read(pd.decode)
    other = prompts(6, [300])[0]  # another prompt under the same id
    redo = await complete(http, pd.decode, decode_leg(pd.model, other, tid, eid))
    want = await complete(http, pd.plain, greedy_body(pd.model, other, MAX_TOKENS))
    assert redo.token_ids == want.token_ids
    moved = PULL_COUNTERS.since(pd.decode, before)
    assert (moved["pulls"], moved["pull_failures"]) == (0, 1)
    assert logged(pd.decode, f"transfer_id {tid[:13]} was used before on this consumer by request")
    await eventually(lambda: nothing_held(pd.prefill) and nothing_held(pd.decode), 15, "freed")


@pytest.mark.provokes_pull_failure
async def test_a_transfer_id_sent_with_two_prompts_at_once_serves_neither_the_others_kv(pd, http):
    """One id, two prompts of the same length, both legs of each at once; the decode of the
    second prompt is first. The producer holds the first prompt's KV under the id and refuses
    the second prefill; it refuses the second decode's acquire (another prompt: by the prompt
    digest, not the length), the decode refuses the first decode (the id is taken), both are
    recomputed token-exact, and the unread lease ends at its TTL."""
    first, second = prompts(7, [400, 400])
    tid, eid = f"xfer-{uuid.uuid4()}", await engine_id(http)
    before = PULL_COUNTERS.read(pd.decode)
    late = asyncio.create_task(complete(http, pd.decode, decode_leg(pd.model, second, tid, eid)))
    await eventually(lambda: pd.decode.metric("vllm:num_requests_waiting") == 1, 10, "parked")
    early = asyncio.create_task(complete(http, pd.decode, decode_leg(pd.model, first, tid, eid)))
    held = await complete(http, pd.prefill, prefill_leg(pd.model, first, tid))
    assert held.kv_transfer_params["transfer_id"] == tid
    refused = await complete(http, pd.prefill, prefill_leg(pd.model, second, tid))
    assert refused.kv_transfer_params is None
    for task, prompt in ((late, second), (early, first)):
        want = await complete(http, pd.plain, greedy_body(pd.model, prompt, MAX_TOKENS))
        assert (await task).token_ids == want.token_ids
    moved = PULL_COUNTERS.since(pd.decode, before)
    assert (moved["pulls"], moved["pull_failures"]) == (0, 2)
    assert logged(pd.decode, f"transfer_id {tid[:13]} holds another prompt's KV")
    assert logged(pd.decode, f"transfer_id {tid[:13]} was used before on this consumer by request")
    await eventually(lambda: nothing_held(pd.decode), 10, "decode freed")
    await eventually(lambda: nothing_held(pd.prefill), pd.lease_ttl_s + 5, "lease expired")


@pytest.mark.provokes_pull_failure
async def test_a_stranger_with_the_transfer_id_gets_nothing_and_the_decode_still_pulls(pd, http):
    """A stranger that has the id (guessed, or read off the wire) and sends its own decode leg,
    to another consumer of the cluster, before the real one: its acquire waits for the lease
    and is refused (its prompt is not the lease's; kv_both fails it, policy fail), while the real
    decode pulls the prompt token-exact. A guessed random id finds nothing to wait for
    (``test_a_decode_whose_producer_never_answers_ends_per_policy``), and side-channel frames
    without the secret get no answer (``test_hostile_peers_e2e``)."""
    prompt, strangers = prompts(9, [500, 500])
    tid, eid = f"xfer-{uuid.uuid4()}", await engine_id(http)
    failed = pd.both.metric("mooncake_vllm:pull_failures_total")
    stranger_body = decode_leg(pd.model, strangers, tid, eid)

    async def stranger() -> int:
        async with http.post(pd.both.url + "/v1/completions", json=stranger_body) as resp:
            return resp.status

    stranger_task = asyncio.create_task(stranger())
    await eventually(lambda: pd.both.metric("vllm:num_requests_waiting") == 1, 10, "parked")
    before = PULL_COUNTERS.read(pd.decode)
    decode = asyncio.create_task(complete(http, pd.decode, decode_leg(pd.model, prompt, tid, eid)))
    assert (await complete(http, pd.prefill, prefill_leg(pd.model, prompt, tid))).kv_transfer_params
    want = await complete(http, pd.plain, greedy_body(pd.model, prompt, MAX_TOKENS))
    assert (await decode).token_ids == want.token_ids
    assert await stranger_task == 500  # no answer from another prompt's KV
    assert pd.both.metric("mooncake_vllm:pull_failures_total") == failed + 1
    assert logged(pd.both, f"transfer_id {tid[:13]} holds another prompt's KV")
    moved = PULL_COUNTERS.since(pd.decode, before)
    assert (moved["pulls"], moved["pull_failures"]) == (1, 0)
    await eventually(
        lambda: nothing_held(pd.prefill) and nothing_held(pd.decode) and nothing_held(pd.both),
        15,
        "freed",
    )


@pytest.mark.provokes_pull_failure
async def test_a_prefill_whose_decode_never_comes_is_freed_at_the_lease_ttl(pd, http):
    """Only the prefill leg arrives (the orchestrator lost the decode): the producer holds the
    prompt until lease_ttl_s and then frees its blocks; a decode leg that comes later is refused
    naming the id and recomputed per policy."""
    prompt = prompts(11, [600])[0]
    tid, eid = f"xfer-{uuid.uuid4()}", await engine_id(http)
    expired = pd.prefill.metric("mooncake_vllm:expired_total")
    t0 = time.monotonic()
    assert (await complete(http, pd.prefill, prefill_leg(pd.model, prompt, tid))).kv_transfer_params
    assert pd.prefill.metric("mooncake_vllm:held_leases") == 1
    await eventually(lambda: nothing_held(pd.prefill), pd.lease_ttl_s + 5, "lease expired")
    took = time.monotonic() - t0
    assert pd.lease_ttl_s - 1 <= took < pd.lease_ttl_s + 5
    assert pd.prefill.metric("mooncake_vllm:expired_total") == expired + 1
    before = PULL_COUNTERS.read(pd.decode)
    late = await complete(http, pd.decode, decode_leg(pd.model, prompt, tid, eid))
    want = await complete(http, pd.plain, greedy_body(pd.model, prompt, MAX_TOKENS))
    assert late.token_ids == want.token_ids
    assert PULL_COUNTERS.since(pd.decode, before)["pull_failures"] == 1
    assert logged(pd.decode, f"transfer {tid[:13]} already expired")
    await eventually(lambda: nothing_held(pd.decode), 10, "decode freed")
