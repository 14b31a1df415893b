"""The proxy's front door and its trust in backends, against fake vLLM servers (no vLLM started).

What a client sees: 401 without the API key (read from a file or the environment), on /metrics
and /health too when they are protected; 429 with ``Retry-After`` over a per-client limit. What a
backend sees: the client's Authorization only when the proxy trusts it (a ``--prefill``/``--decode``
flag, or a discovered engine whose registry record verified under the shared secret).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import test_proxy_faults as faults
from aiohttp import web

from harness.servers import free_port
from mooncake_vllm.core import auth
from mooncake_vllm.core.registry import ServingRecord, encode_serving, serving_key
from mooncake_vllm.metadata import MemoryStore
from mooncake_vllm.transfer.store_bridge import metadata_app

# The fake vLLM servers of test_proxy_faults (the in-process proxy: conftest's start_proxy).
fakes, prefill, decode, client = faults.fakes, faults.prefill, faults.decode, faults.client
eventually, metric_value, HANDOFF = faults.eventually, faults.metric_value, faults.HANDOFF

BODY = {"prompt": "x", "max_tokens": 4}
KEY_1, KEY_2 = "client-key-one", "client-key-two"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def post(client: aiohttp.ClientSession, proxy: str, **kwargs: Any) -> tuple[int, Any, Any]:
    """POST a completion; (status, JSON answer, headers)."""
    async with client.post(proxy + "/v1/completions", json=BODY, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None), resp.headers


# ---- the API key --------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["file", "env"])
async def test_api_key_from_a_file_or_the_environment(
    source, prefill, decode, start_proxy, client, tmp_path, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", "backend-key")
    if source == "file":
        path = tmp_path / "keys"
        path.write_text(f"{KEY_1}\n\n  {KEY_2}  \n")  # two keys: rotation
        where = {"api_key_file": str(path)}
    else:
        monkeypatch.setenv("PROXY_KEYS", f"{KEY_1}\n{KEY_2}")
        where = {"api_key_env": "PROXY_KEYS"}
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], **where)

    for headers in ({}, bearer("wrong"), {"Authorization": KEY_1}, bearer(KEY_1 + "x")):
        status, answer, resp_headers = await post(client, proxy, headers=headers)
        assert status == 401
        assert answer["error"]["type"] == "authentication_error"
        assert answer["error"]["code"] == "invalid_api_key"
        assert resp_headers["WWW-Authenticate"] == "Bearer"
    assert prefill.generation_requests() == decode.generation_requests() == []

    for key in (KEY_1, KEY_2):
        status, _, _ = await post(client, proxy, headers=bearer(key))
        assert status == 200
    for seen in prefill.generation_requests() + decode.generation_requests():
        assert seen.headers["Authorization"] == "Bearer backend-key"  # never the client's key
    for path in ("/health", "/metrics"):  # unprotected by default: probes need no key
        async with client.get(proxy + path) as resp:
            assert resp.status == 200


async def test_protected_metrics_and_health_ask_for_the_key(
    prefill, decode, start_proxy, client, monkeypatch
):
    monkeypatch.setenv("PROXY_KEY", KEY_1)
    proxy = await start_proxy(
        prefill=[prefill.url],
        decode=[decode.url],
        api_key_env="PROXY_KEY",
        protect_metrics=True,
        protect_health=True,
    )
    for path in ("/metrics", "/health"):
        for headers in ({}, bearer("wrong")):
            async with client.get(proxy + path, headers=headers) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["code"] == "invalid_api_key"
        async with client.get(proxy + path, headers=bearer(KEY_1)) as resp:
            assert resp.status == 200
    async with client.get(proxy + "/metrics", headers=bearer(KEY_1)) as resp:
        text = await resp.text()
    assert 'mooncake_proxy_requests_total{endpoint="/metrics",status="401"} 2.0' in text


# ---- per-client limits --------------------------------------------------------------------------


async def test_over_the_rate_a_client_gets_429_with_retry_after(
    prefill, decode, start_proxy, client
):
    # One request per 20 s: a slow first request cannot let the second one through.
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], client_rate=0.05)
    assert (await post(client, proxy))[0] == 200  # the burst: one second's worth, at least 1
    status, answer, headers = await post(client, proxy)
    assert status == 429
    assert answer["error"]["type"] == "rate_limit_error"
    assert answer["error"]["code"] == "rate_limit_exceeded"
    assert "--client-rate" in answer["error"]["message"]
    assert 19 <= int(headers["Retry-After"]) <= 20  # until the next token
    assert len(decode.generation_requests()) == 1  # the refused one reached no backend
    async with client.get(proxy + "/health") as resp:  # probes are not limited
        assert resp.status == 200
    sample = 'mooncake_proxy_client_limited_total{reason="rate"}'
    assert await metric_value(client, proxy, sample) == 1.0


async def test_a_client_is_its_checked_api_key_else_its_address(
    prefill, decode, start_proxy, client, tmp_path
):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_1}\n{KEY_2}\n")
    proxy = await start_proxy(
        prefill=[prefill.url], decode=[decode.url], api_key_file=str(keys), client_rate=0.01
    )
    assert (await post(client, proxy, headers=bearer(KEY_1)))[0] == 200
    assert (await post(client, proxy, headers=bearer(KEY_1)))[0] == 429
    assert (await post(client, proxy, headers=bearer(KEY_2)))[0] == 200  # another client
    assert (await post(client, proxy, headers=bearer("wrong")))[0] == 401  # checked first

    # Without a key of its own the proxy cannot check one: a client is its address, whatever
    # Authorization it sends (else a new header per request would be a new client).
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], client_rate=0.01)
    assert (await post(client, proxy, headers=bearer("a")))[0] == 200
    assert (await post(client, proxy, headers=bearer("b")))[0] == 429


async def test_a_streamed_answer_holds_its_slot_until_it_ends(fakes, prefill, start_proxy, client):
    release = asyncio.Event()
    decode = await fakes("decode", hold_after_first_chunk=release)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], client_max_concurrency=1)
    stream_body = {**BODY, "stream": True}
    async with client.post(proxy + "/v1/completions", json=stream_body) as stream:
        assert stream.status == 200
        await stream.content.readuntil(b"\n\n")  # the first event: the stream is open
        status, answer, headers = await post(client, proxy)
        assert status == 429
        assert answer["error"]["code"] == "concurrency_limit_exceeded"
        assert headers["Retry-After"] == "1"
        release.set()
        rest = await stream.read()
    assert rest.endswith(b"data: [DONE]\n\n")

    async def admitted() -> bool:
        return (await post(client, proxy))[0] == 200

    await eventually(admitted)  # the slot came back when the stream ended
    sample = 'mooncake_proxy_client_limited_total{reason="concurrency"}'
    assert await metric_value(client, proxy, sample) == 1.0


async def test_a_client_leaving_mid_stream_gives_its_slot_back(fakes, prefill, start_proxy, client):
    decode = await fakes("decode", endless_stream=True)
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url], client_max_concurrency=1)
    async with aiohttp.ClientSession() as leaving:
        resp = await leaving.post(proxy + "/v1/completions", json={**BODY, "stream": True})
        await resp.content.readuntil(b"\n\n")
        assert (await post(client, proxy))[0] == 429
        resp.close()  # the client goes away
    await asyncio.wait_for(decode.stream_closed.wait(), 5)
    decode.endless_stream = False

    async def admitted() -> bool:
        return (await post(client, proxy))[0] == 200

    await eventually(admitted)


# ---- discovered backends: signed records and trust ----------------------------------------------

SECRET = auth.new_secret()
OTHER_SECRET = auth.new_secret()


@pytest.fixture
async def registry():
    """An http metadata store in this process (``metadata_server``'s app): (URL, store)."""
    store = MemoryStore()
    runner = web.AppRunner(metadata_app(store))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}/metadata", store
    await runner.cleanup()


def serving_record(engine_id: str, role: str, url: str) -> bytes:
    record = ServingRecord(engine_id=engine_id, role=role, url=url, compat_hash="c")
    return encode_serving(record)


async def pool_urls(client: aiohttp.ClientSession, proxy: str, role: str) -> dict[str, bool]:
    """``{url: trusted}`` of the backends in rotation in the ``role`` pool."""
    async with client.get(proxy + "/health") as resp:
        report = await resp.json()
    return {b["url"]: b["trusted"] for b in report[role] if b["healthy"]}


@pytest.mark.parametrize("with_secret", [True, False])
async def test_authorization_goes_only_to_trusted_backends(
    with_secret, fakes, prefill, registry, start_proxy, client, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", "backend-key")
    monkeypatch.setenv("MOONCAKE_SECRET", SECRET)
    store_url, store = registry
    decode = await fakes("decode")
    record = serving_record("d1", "kv_consumer", decode.url)
    await store.put(serving_key("d1"), auth.seal_record((SECRET.encode(),), record))
    secret = {"auth_secret_env": "MOONCAKE_SECRET"} if with_secret else {}
    proxy = await start_proxy(
        prefill=[prefill.url], discover=store_url, discover_interval_s=0.1, **secret
    )

    async def decode_in_rotation() -> dict[str, bool]:
        return await pool_urls(client, proxy, "decode")

    assert await eventually(decode_in_rotation) == {decode.url: with_secret}
    assert (await post(client, proxy, headers=bearer("client-key")))[0] == 200

    # The static prefill is trusted: it gets the client's key, as before.
    [prefill_seen] = prefill.generation_requests()
    assert prefill_seen.headers["Authorization"] == "Bearer client-key"
    [decode_seen] = decode.generation_requests()
    if with_secret:  # its record verified: trusted like a static backend
        assert decode_seen.headers["Authorization"] == "Bearer client-key"
    else:  # anyone who can write to the store could have put it there: no key of any kind
        assert "Authorization" not in decode_seen.headers
    assert decode_seen.body["kv_transfer_params"] == HANDOFF  # otherwise the same request


async def test_unsigned_and_forged_records_are_ignored_and_counted(
    fakes, prefill, registry, start_proxy, client, monkeypatch
):
    monkeypatch.setenv("MOONCAKE_SECRET", SECRET)
    store_url, store = registry
    genuine, unsigned, forged = [await fakes("decode") for _ in range(3)]
    await store.put(
        serving_key("genuine"),
        auth.seal_record((SECRET.encode(),), serving_record("genuine", "kv_consumer", genuine.url)),
    )
    await store.put(serving_key("unsigned"), serving_record("u", "kv_consumer", unsigned.url))
    await store.put(
        serving_key("forged"),
        auth.seal_record(
            (OTHER_SECRET.encode(),), serving_record("forged", "kv_consumer", forged.url)
        ),
    )
    proxy = await start_proxy(
        prefill=[prefill.url],
        discover=store_url,
        discover_interval_s=0.1,
        auth_secret_env="MOONCAKE_SECRET",
    )

    async def genuine_in_rotation() -> dict[str, bool]:
        return await pool_urls(client, proxy, "decode")

    assert await eventually(genuine_in_rotation) == {genuine.url: True}
    await asyncio.sleep(0.3)  # a few more registry reads: counted once per key, not per read
    for reason in ("unsigned", "bad_signature"):
        sample = f'mooncake_proxy_registry_records_ignored_total{{reason="{reason}"}}'
        assert await metric_value(client, proxy, sample) == 1.0
    for _ in range(3):
        assert (await post(client, proxy))[0] == 200
    assert len(genuine.generation_requests()) == 3
    assert unsigned.generation_requests() == forged.generation_requests() == []
