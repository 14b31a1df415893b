"""A pair started with vLLM's own command, as vLLM's and Mooncake's guides write it:

    MOONCAKE_CONFIG_PATH=mooncake.json vllm serve MODEL \\
        --kv-transfer-config '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}'

and what vLLM's ``pause_generation`` (``POST /pause``, ``VLLM_SERVER_DEV_MODE=1``) does to a
prefill that holds a lease: the pause waits until the lease ends, the blocks are never freed under
it, and after ``/resume`` the pair hands KV over as before.
"""

from __future__ import annotations

import random
import time
import uuid

import pytest

from harness import pd, servers

pytestmark = pytest.mark.servers

HOST = "127.0.0.1"
LEASE_TTL_S = 6.0


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    specs = pd.readme_pair(
        tmp_path_factory.mktemp("vllm-serve") / "mooncake.json",
        "cli",
        HOST,
        env={"VLLM_SERVER_DEV_MODE": "1"},
        cli=True,
        prefill_url=f"{HOST}:{servers.free_port(HOST)}",
        decode_url=f"{HOST}:{servers.free_port(HOST)}",
        lease_ttl_s=LEASE_TTL_S,
    )
    prefill, decode = pd.start_many(tiny_model, specs)
    with servers.running(prefill), servers.running(decode):
        yield prefill, decode


@pytest.fixture
def show_logs(pair, request):
    yield
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        for srv in pair:
            print(f"\n===== log of {srv.process.name} =====\n{srv.process.log_tail(30_000)}")


async def test_a_pair_started_with_vllm_serve_hands_kv_over(pair, tiny_model, show_logs):
    prefill, decode = pair
    for srv in pair:
        assert srv.process.argv[1:3] == ["serve", tiny_model]  # vllm serve MODEL ...
    before, ext0 = pd.PULL_COUNTERS.read(decode), pd.tokens_by_transfer(decode)
    rng = random.Random(7)  # no shared prefix: the decode's own prefix cache cannot serve them
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (40, 300, 700)]
    async with pd.client_session() as http:
        for prompt in prompts:
            body = {"model": tiny_model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            _, tail = await pd.two_legs(http, prefill, decode, body)
            assert len(tail.token_ids) == 6
    pulls = await pd.pulls_since(decode, before, len(prompts))
    assert (pulls["pulls"], pulls["pull_failures"]) == (len(prompts), 0)
    # The last token of each prompt is computed by the decode; the rest arrived by transfer.
    want = sum(len(p) - 1 for p in prompts)
    await pd.eventually(
        lambda: pd.tokens_by_transfer(decode) - ext0 >= want, 10, "prompt tokens by transfer"
    )


async def test_pause_waits_for_a_held_lease_and_resume_serves_again(pair, tiny_model, show_logs):
    prefill, decode = pair
    prompt = list(range(7, 507))
    body = {"model": tiny_model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with pd.client_session() as http:
        params = {"do_remote_decode": True, "transfer_id": str(uuid.uuid4())}
        await pd.complete(http, prefill, {**body, "max_tokens": 1, "kv_transfer_params": params})
        held = await pd.eventually(lambda: prefill.metric("mooncake_vllm:held_leases") == 1, 5)
        # Nobody pulls: the pause completes only when the lease expires and vLLM frees the
        # request's blocks (an aborted running request would be freed at once).
        t0 = time.monotonic()
        async with http.post(f"{prefill.url}/pause", params={"mode": "abort"}) as resp:
            assert resp.status == 200, await resp.text()
        paused_after_s = time.monotonic() - t0
        try:
            assert prefill.metric("mooncake_vllm:held_leases") == 0
            assert paused_after_s >= LEASE_TTL_S - held - 1.0, paused_after_s
        finally:
            async with http.post(f"{prefill.url}/resume") as resp:
                assert resp.status == 200, await resp.text()
        before = pd.PULL_COUNTERS.read(decode)
        _, tail = await pd.two_legs(http, prefill, decode, body)
        assert len(tail.token_ids) == 4
    pulls = await pd.pulls_since(decode, before, 1)
    assert (pulls["pulls"], pulls["pull_failures"]) == (1, 0)
    print(f"pause returned after {paused_after_s:.1f} s (lease TTL {LEASE_TTL_S} s)")
