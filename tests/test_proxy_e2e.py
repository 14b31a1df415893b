"""The proxy in front of real vLLM servers: the prefill/decode pair with MooncakeConnector.

The proxy runs as users run it, ``python proxy/proxy_server.py --prefill URL --decode URL``;
outputs are compared token for token with a plain vLLM.
"""

from __future__ import annotations

import random

import pytest

from harness import servers
from harness.pd import complete, eventually, sse_events, tokens_by_transfer
from harness.xpyd import start_pair_proxy

pytestmark = pytest.mark.servers


@pytest.fixture(scope="module")
def proxy(cluster):
    with servers.running(start_pair_proxy(cluster.prefill.url, cluster.decode.url)) as proxy:
        yield proxy.url


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_completions_through_the_proxy_equal_plain(pd, proxy, http, stream):
    pulls0 = pd.decode.metric("mooncake_vllm:pulls_total")
    ext0 = tokens_by_transfer(pd.decode)
    lengths = [5, 130, 700, 1300]
    for i, n in enumerate(lengths):
        prompt = prompt_ids(200 + 10 * stream + i, n)
        body = {"model": pd.model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        ref = await complete(http, pd.plain, body)
        got = await complete(http, proxy, {**body, "stream": stream})
        assert got.token_ids == ref.token_ids, f"prompt of {n} tokens"
    await eventually(lambda: pd.decode.metric("mooncake_vllm:pulls_total") - pulls0 == len(lengths))
    assert tokens_by_transfer(pd.decode) - ext0 >= sum(lengths) - len(lengths)


async def _chat(http, url: str, body: dict) -> str:
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not body.get("stream"):
            return (await resp.json())["choices"][0]["message"]["content"]
        parts = []
        async for event in sse_events(resp):
            for choice in event.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
        return "".join(parts)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_chat_through_the_proxy_equals_plain(pd, proxy, http, stream):
    pulls0 = pd.decode.metric("mooncake_vllm:pulls_total")
    text = f"Explain prefill and decode disaggregation, variant {int(stream)}. " * 20
    body = {
        "model": pd.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 16,
        "temperature": 0,
    }
    ref = await _chat(http, pd.plain.url, body)
    got = await _chat(http, proxy, {**body, "stream": stream})
    assert got == ref
    await eventually(lambda: pd.decode.metric("mooncake_vllm:pulls_total") == pulls0 + 1)


async def test_client_disconnect_mid_stream_frees_the_decode(pd, proxy, http):
    body = {
        "model": pd.model,
        "prompt": prompt_ids(300, 400),
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with http.post(f"{proxy}/v1/completions", json=body) as resp:
        assert resp.status == 200
        chunks = 0
        async for _ in resp.content:
            chunks += 1
            if chunks >= 3:
                break
        await eventually(lambda: pd.decode.metric("vllm:num_requests_running") == 1, 10)
        resp.close()  # the client goes away mid-stream
    await eventually(lambda: pd.decode.metric("vllm:num_requests_running") == 0, 10)
    await eventually(lambda: pd.prefill.metric("mooncake_vllm:held_leases") == 0)


async def test_decode_rejection_reaches_the_client_with_its_status(pd, proxy, http):
    # Too long for decode's max_model_len: vLLM's 400 must reach the client as a 400.
    body = {"model": pd.model, "prompt": prompt_ids(400, 100), "max_tokens": 50_000}
    for stream in (False, True):
        async with http.post(f"{proxy}/v1/completions", json={**body, "stream": stream}) as resp:
            assert resp.status == 400
            err = await resp.json()
            assert "error" in err and err["error"]["message"]
