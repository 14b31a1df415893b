"""One client request, one trace: the proxy's spans, vLLM's own and ours, collected by an
OTLP/HTTP receiver in this process (opentelemetry-proto's messages, no collector).

A README pair on 127.0.0.14 with vLLM's ``--otlp-traces-endpoint`` (and
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``, as vLLM reads it) and our proxy with its
own ``--otlp-traces-endpoint``; the client sends a W3C ``traceparent``. The tree asserted::

    client span (the test's)
    └── proxy.request                      (the proxy)
        ├── proxy.prefill                  (the proxy)
        │   ├── llm_request                (vLLM, prefill engine)
        │   └── mooncake.lease             (ours, prefill engine: held until released)
        └── proxy.decode                   (the proxy)
            ├── llm_request                (vLLM, decode engine)
            ├── mooncake.pull              (ours, decode worker: bytes, blocks, transfer id)
            │   ├── mooncake.acquire
            │   └── mooncake.read
            └── mooncake.release

and a pull that fails (a transfer id its producer never held, vLLM's default ``fail`` policy)
is one ``mooncake.pull`` span with an error status and the reason as an attribute.
"""

from __future__ import annotations

import os
import secrets
from unittest import mock

import aiohttp
import pytest

from harness.otlp import Receiver, one_span, traceparent
from harness.pd import ServerSpec, complete, greedy_body, kv_args, start_many, stop_servers
from harness.xpyd import start_proxy

pytestmark = [pytest.mark.servers, pytest.mark.long]

HOST = "127.0.0.14"
# Spans out within a fifth of a second (the SDK's batch default is 5 s).
OTEL_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"}


@pytest.fixture(scope="module")
def traced(cluster, request):
    receiver = Receiver()
    otlp = ["--otlp-traces-endpoint", receiver.endpoint]
    env = {"MOONCAKE_CONFIG_PATH": str(cluster.config_path), **OTEL_ENV}
    prefill_args = [*kv_args("kv_producer", {"prefill_url": f"{HOST}:13240"}), *otlp]
    decode_args = [*kv_args("kv_consumer", {"decode_url": f"{HOST}:13250"}), *otlp]
    specs = [
        ServerSpec("prefill-traced", HOST, prefill_args, env),
        ServerSpec("decode-traced", HOST, decode_args, env),
    ]
    prefill, decode = start_many(cluster.model, specs)
    with mock.patch.dict(os.environ, OTEL_ENV):
        proxy = start_proxy(["--prefill", prefill.url, "--decode", decode.url, *otlp])
    yield {"receiver": receiver, "prefill": prefill, "decode": decode, "proxy": proxy}
    proxy.stop()
    stop_servers([prefill, decode], print_logs=request.session.testsfailed > 0)
    receiver.stop()


TREE = {"proxy.request", "proxy.prefill", "proxy.decode", "llm_request", "mooncake.lease",
        "mooncake.pull", "mooncake.acquire", "mooncake.read", "mooncake.release"}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_one_request_is_one_trace_through_proxy_prefill_and_decode(traced, cluster, stream):
    receiver, proxy = traced["receiver"], traced["proxy"]
    parent, trace_id, client_span = traceparent()
    # Each case its own prompt: none of it in the decode's prefix cache, so all 3 blocks pulled.
    prompt = list(range(100 + 1000 * stream, 400 + 1000 * stream))
    body = {**greedy_body(cluster.model, prompt, 8), "stream": stream, "return_token_ids": True}
    async with aiohttp.ClientSession() as http:
        headers = {"traceparent": parent}
        async with http.post(f"{proxy.url}/v1/completions", json=body, headers=headers) as resp:
            text = await resp.text()
            assert resp.status == 200, text
        ref = await complete(http, cluster.plain, greedy_body(cluster.model, prompt, 8))
    assert str(ref.token_ids[0]) in text  # the pair's first token is the plain vLLM's
    spans = receiver.wait_for(trace_id, TREE)
    root = one_span(spans, "proxy.request")
    assert root["parent"] == client_span and root["service"] == "mooncake-vllm-proxy"
    assert root["attributes"]["http.status_code"] == 200
    prefill_leg = one_span(spans, "proxy.prefill", root)
    decode_leg = one_span(spans, "proxy.decode", root)
    assert prefill_leg["attributes"]["mooncake.backend"] == traced["prefill"].url
    assert decode_leg["attributes"]["mooncake.backend"] == traced["decode"].url
    # vLLM's own span on each engine, a child of the leg that reached it.
    one_span(spans, "llm_request", prefill_leg)
    one_span(spans, "llm_request", decode_leg)
    pull = one_span(spans, "mooncake.pull", decode_leg)
    assert pull["service"] == "mooncake-vllm-connector" and not pull["error"]
    assert pull["attributes"]["mooncake.ok"] is True
    assert pull["attributes"]["mooncake.bytes"] > 0 and pull["attributes"]["mooncake.blocks"] == 3
    tid = pull["attributes"]["mooncake.transfer_id"]
    one_span(spans, "mooncake.acquire", pull)
    read = one_span(spans, "mooncake.read", pull)
    assert read["attributes"]["mooncake.bytes"] == pull["attributes"]["mooncake.bytes"]
    release = one_span(spans, "mooncake.release", decode_leg)
    assert release["attributes"]["mooncake.transfer_id"] == tid
    lease = one_span(spans, "mooncake.lease", prefill_leg)
    assert lease["attributes"]["mooncake.transfer_id"] == tid
    assert lease["attributes"]["mooncake.lease.end_reason"] == "released" and not lease["error"]


async def test_a_failed_pull_is_one_span_with_its_reason(traced, cluster):
    """The decode leg sent straight to the decode (as an orchestrator would) with a transfer id
    its producer never held: vLLM's ``fail`` policy answers an error, and the trace says why."""
    receiver, prefill, decode = traced["receiver"], traced["prefill"], traced["decode"]
    prompt = list(range(500, 800))
    body = greedy_body(cluster.model, prompt, 1)
    async with aiohttp.ClientSession() as http:
        leg = {**body, "kv_transfer_params": {"do_remote_decode": True}}
        async with http.post(f"{prefill.url}/v1/completions", json=leg) as resp:
            params = (await resp.json())["kv_transfer_params"]
        params = {**params, "transfer_id": "never-held-" + secrets.token_hex(4)}
        parent, trace_id, client_span = traceparent()
        async with http.post(
            f"{decode.url}/v1/completions",
            json={**body, "max_tokens": 4, "kv_transfer_params": params},
            headers={"traceparent": parent},
        ) as resp:
            text = await resp.text()
    assert resp.status >= 400, text
    spans = receiver.wait_for(trace_id, {"mooncake.pull"})
    pull = one_span(spans, "mooncake.pull")
    assert pull["parent"] == client_span and pull["error"], pull
    reason = pull["attributes"]["mooncake.failure_reason"]
    assert "never-held" in reason or "unknown" in reason or "refused" in reason, reason
    assert pull["attributes"]["mooncake.ok"] is False
