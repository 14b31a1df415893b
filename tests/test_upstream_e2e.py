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
from types import SimpleNamespace

import pytest

from harness.pd import PULL_COUNTERS, complete, eventually, greedy_body, tokens_by_transfer
from harness.servers import metric_samples
from harness.upstream_clients import (
    DynamoVllm,
    LlmdMooncake,
    LlmdNixlV2,
    RayServePD,
    VllmMooncakeProxy,
)
from tests.test_concurrent_e2e import nothing_held

pytestmark = pytest.mark.servers

MAX_TOKENS = 8
PREFILL_BOOTSTRAP = "127.0.0.2:8998"  # the cluster prefill's bootstrap_server_address
BOOTSTRAP = f"http://{PREFILL_BOOTSTRAP}"


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


async def answer_events(resp) -> list[dict]:
    """A response's JSON body, or each event of its SSE stream up to ``[DONE]``; releases it."""
    async with resp:
        if resp.content_type == "application/json":
            return [await resp.json()]
        events = []
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                events.append(json.loads(line[5:]))
        return events


async def read_answer(resp, chat: bool) -> tuple[list[int], str]:
    """Token ids (completions) and text of a response, streamed or not; releases it."""
    ids, text = [], []
    for event in await answer_events(resp):
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


async def dynamo_client(http, pd) -> DynamoVllm:
    """Dynamo's handlers with the cluster prefill's config as its prefill worker holds it."""
    from vllm.config import KVTransferConfig

    extra = {"bootstrap_server_address": PREFILL_BOOTSTRAP}  # as conftest gives the prefill
    prefill_config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeConnector", kv_role="kv_producer",
            engine_id=await engine_id(http), kv_connector_extra_config=extra,
        ),
        parallel_config=SimpleNamespace(
            local_engines_only=False, nnodes_within_dp=1, data_parallel_master_ip="127.0.0.1"
        ),
    )  # fmt: skip
    return DynamoVllm(http, pd.prefill.url, pd.decode.url, prefill_config)


async def run_flow(pd, http, post, prefill_tasks, seed: int, prefill=None) -> None:
    """Completions (1-1500 tokens) and chats, streamed and not, at concurrency 8 through an
    orchestrator's ``post``: every answer equal to the plain vLLM's, every prompt by transfer, no
    pull failed (the ``pd`` fixture), nothing held afterwards."""
    prefill = prefill or pd.prefill
    batch = prompts(seed, [1, 127, 128, 129, 300, 640, 1000, 1500] * 2)
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
    await asyncio.gather(*prefill_tasks)
    await eventually(
        lambda: PULL_COUNTERS.since(pd.decode, before)["pulls"] >= len(jobs), 10, "pulls"
    )
    assert PULL_COUNTERS.since(pd.decode, before)["pull_failures"] == 0
    total = sum(len(p) for p in batch)
    by_transfer = tokens_by_transfer(pd.decode) - before_tokens
    # vLLM may count each prompt's last token as computed; the chats' prompts come on top.
    assert by_transfer >= 0.99 * (total - len(batch))
    await eventually(lambda: nothing_held(prefill) and nothing_held(pd.decode), 15, "freed")


@pytest.mark.parametrize("flow", ["vllm-proxy", "llm-d", "dynamo", "llm-d-nixlv2", "ray-serve"])
async def test_an_upstream_orchestrators_flow_is_token_exact_and_pulled(pd, http, flow):
    """vLLM's mooncake proxy, llm-d's sidecar (``--kv-connector mooncake``) and Dynamo's vLLM
    handlers; and, in the NIXL-style convention, llm-d's ``nixlv2`` and Ray Serve LLM's P/D
    proxy: as ``harness.upstream_clients`` plays them (``run_flow``)."""
    if flow == "vllm-proxy":
        client = VllmMooncakeProxy(http, [(pd.prefill.url, None)], [pd.decode.url])
        await client.start()
        post = client.post
    elif flow == "llm-d":
        client = LlmdMooncake(http, pd.decode.url)

        def post(api, body):
            return client.post(pd.prefill.url, api, body)
    elif flow == "dynamo":
        client = await dynamo_client(http, pd)
        assert client.bootstrap_addr == BOOTSTRAP
        post = client.post
    elif flow == "llm-d-nixlv2":
        client = LlmdNixlV2(http, pd.prefill.url, pd.decode.url)
        post = client.post
    else:
        client = RayServePD(http, pd.prefill.url, pd.decode.url)
        post = client.post
    seed = {"vllm-proxy": 41, "llm-d": 37, "dynamo": 43, "llm-d-nixlv2": 53, "ray-serve": 59}[flow]
    # Timed from here: building the Dynamo client imports vLLM's config and connector modules
    # into this process (10-20 s on 2 cores), which is the test's cost, not the flow's.
    t0 = time.monotonic()
    await run_flow(pd, http, post, client.prefill_tasks, seed)
    print(f"{flow}: 20 requests at c=8 in {time.monotonic() - t0:.1f}s")


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


# ---- data parallel --------------------------------------------------------------------------

DP_HOST = "127.0.0.31"


@pytest.fixture(scope="module")
def dp_prefill(cluster):
    """vLLM's ``--data-parallel-size 2`` prefill (one engine core per DP rank, each pinned to
    its own core), with the cluster's config and secret, so the cluster's decode pulls from it."""
    from harness.pd import ServerSpec, kv_args, start_many

    env = {
        "MOONCAKE_CONFIG_PATH": str(cluster.config_path),
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    args = [*kv_args("kv_producer", {"prefill_url": f"{DP_HOST}:13100"}),
            "--data-parallel-size", "2"]  # fmt: skip
    (srv,) = start_many(cluster.model, [ServerSpec("prefill-dp2", DP_HOST, args, env)])
    yield srv
    srv.stop()


def requests_by_engine(srv) -> dict[str, float]:
    """Finished requests per DP rank (vLLM labels each engine core's metrics ``engine``)."""
    out: dict[str, float] = {}
    for sample in metric_samples(f"{srv.url}/metrics", ["vllm:request_success_total"]):
        engine = sample.labels.get("engine", "")
        out[engine] = out.get(engine, 0.0) + sample.value
    return out


@pytest.mark.long
async def test_a_data_parallel_prefill_lists_both_ranks_and_serves_the_one_asked(
    pd, http, dp_prefill
):
    """``/query`` lists both DP ranks, each with its engine id (vLLM's ``<id>_dp<rank>``) and
    its own side channel; vLLM's proxy flow cycles over them (header ``X-data-parallel-rank``)
    and every answer is the plain vLLM's, pulled from the rank that computed it."""
    async with http.get(f"http://{DP_HOST}:8998/query") as resp:
        data = await resp.json()
    assert sorted(data) == ["0", "1"]
    ids = [data[r]["engine_id"] for r in ("0", "1")]
    assert ids[0].endswith("_dp0") and ids[1] == ids[0].removesuffix("_dp0") + "_dp1"
    assert [data[r]["worker_addr"] for r in ("0", "1")] == [
        {"0": {"0": f"tcp://{DP_HOST}:13101"}},
        {"0": {"0": f"tcp://{DP_HOST}:13103"}},
    ]
    before = requests_by_engine(dp_prefill)
    client = VllmMooncakeProxy(http, [(dp_prefill.url, None)], [pd.decode.url])
    await client.start()
    await run_flow(pd, http, client.post, client.prefill_tasks, 47, prefill=dp_prefill)
    served = {k: v - before.get(k, 0.0) for k, v in requests_by_engine(dp_prefill).items()}
    assert served == {"0": 10, "1": 10}  # 20 prefill legs, round robin over the two ranks
