"""Our spans without engines: ``core.tracing``'s trees, the proxy's request and leg spans (in
this process, fake backends, spans sent to an in-process OTLP/HTTP receiver), the client's
``traceparent`` forwarded when tracing is off, nothing of OpenTelemetry imported then, and the
lease table's per-request end reasons."""

from __future__ import annotations

import subprocess
import sys
from functools import partial

import aiohttp
import pytest

from harness.otlp import Receiver, one_span, traceparent
from mooncake_vllm.core import tracing
from tests.test_proxy_faults import HANDOFF, FakeVllm


@pytest.fixture
def fakes(start_fake):
    return partial(start_fake, FakeVllm)


@pytest.fixture
async def client():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    r = Receiver()
    yield r
    tracing.shutdown()
    r.stop()


def test_a_measured_span_and_its_children_go_under_the_callers_trace(receiver):
    t = tracing.tracer(receiver.endpoint, "unit")
    parent, trace_id, client_span = traceparent()
    span = tracing.Span("mooncake.pull", 1_000, 9_000, {"mooncake.bytes": 4096, "none": None})
    span.child("mooncake.acquire", 1_000, 2_000)
    span.child("mooncake.read", 5_000, 9_000, **{"mooncake.blocks": 3})
    span.error = "x" * 2000
    tracing.record(t, span, {"traceparent": parent})
    spans = receiver.wait_for(trace_id, {"mooncake.pull", "mooncake.acquire", "mooncake.read"})
    pull = one_span(spans, "mooncake.pull")
    assert pull["parent"] == client_span and pull["service"] == "unit"
    assert pull["attributes"] == {"mooncake.bytes": 4096}  # None left out
    assert pull["error"] and len(pull["status_message"]) == tracing.MAX_ATTRIBUTE_CHARS
    one_span(spans, "mooncake.acquire", pull)
    assert one_span(spans, "mooncake.read", pull)["attributes"] == {"mooncake.blocks": 3}


def test_off_is_none_and_every_call_returns():
    assert tracing.tracer(None, "unit") is None
    tracing.record(None, tracing.Span("x", 0, 1), {"traceparent": "00-bad"})
    tracing.end(None, "error")
    assert tracing.headers_of(None) == {}
    assert tracing.trace_headers({"TraceParent": "a", "x": "b", "tracestate": "c" * 2000}) == {
        "traceparent": "a"
    }


def test_a_bad_protocol_names_the_variable(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='thrift'"):
        tracing.tracer("http://127.0.0.1:9/v1/traces", "bad-protocol")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_proxy_spans_a_request_and_each_leg_and_hands_each_leg_its_own_parent(
    receiver, fakes, start_proxy, client, stream
):
    prefill, decode = await fakes("prefill", handoff=HANDOFF), await fakes("decode")
    proxy = await start_proxy(
        prefill=[prefill.url], decode=[decode.url], otlp_traces_endpoint=receiver.endpoint
    )
    parent, trace_id, client_span = traceparent()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": stream}
    async with client.post(
        proxy + "/v1/completions", json=body, headers={"traceparent": parent}
    ) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    spans = receiver.wait_for(trace_id, {"proxy.request", "proxy.prefill", "proxy.decode"})
    root = one_span(spans, "proxy.request")
    assert root["parent"] == client_span and root["service"] == tracing.PROXY_SERVICE
    assert root["attributes"]["http.status_code"] == 200
    legs = {name: one_span(spans, f"proxy.{name}", root) for name in ("prefill", "decode")}
    for name, fake in (("prefill", prefill), ("decode", decode)):
        (seen,) = fake.generation_requests()
        sent = seen.headers["traceparent"].split("-")
        assert sent[1] == trace_id and sent[2] == legs[name]["span_id"], (name, sent)
        assert legs[name]["attributes"]["mooncake.backend"] == fake.url
        assert not legs[name]["error"]


async def test_a_failed_leg_is_an_error_span_and_the_request_one_too(
    receiver, fakes, start_proxy, client
):
    prefill = await fakes("prefill", handoff=HANDOFF, status=500)
    decode = await fakes("decode")
    proxy = await start_proxy(
        prefill=[prefill.url], decode=[decode.url], otlp_traces_endpoint=receiver.endpoint
    )
    parent, trace_id, _ = traceparent()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    async with client.post(
        proxy + "/v1/completions", json=body, headers={"traceparent": parent}
    ) as resp:
        assert resp.status >= 500
    spans = receiver.wait_for(trace_id, {"proxy.request", "proxy.prefill"})
    root = one_span(spans, "proxy.request")
    assert root["error"] and root["attributes"]["http.status_code"] == resp.status
    assert not [s for s in spans if s["name"] == "proxy.decode"]


async def test_tracing_off_forwards_the_clients_traceparent(fakes, start_proxy, client):
    prefill, decode = await fakes("prefill", handoff=HANDOFF), await fakes("decode")
    proxy = await start_proxy(prefill=[prefill.url], decode=[decode.url])
    parent, _, _ = traceparent()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    headers = {"traceparent": parent, "tracestate": "vendor=1"}
    async with client.post(proxy + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
    for fake in (prefill, decode):
        (seen,) = fake.generation_requests()
        assert seen.headers["traceparent"] == parent and seen.headers["tracestate"] == "vendor=1"


def test_off_imports_nothing_of_opentelemetry():
    """Off, the proxy imports no OpenTelemetry at all, and the connector none of the tracing SDK
    or an exporter (vLLM itself imports ``opentelemetry.sdk.metrics``)."""
    code = (
        "import sys\n"
        "from mooncake_vllm.proxy.app import create_app\n"
        "from mooncake_vllm.proxy.config import ProxyConfig\n"
        "create_app(ProxyConfig(prefill=['http://127.0.0.1:9'], decode=['http://127.0.0.1:9']))\n"
        "proxy = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not proxy, proxy\n"
        "import mooncake_vllm.p2p.worker, mooncake_vllm.p2p.scheduler\n"
        "bad = ('opentelemetry.sdk.trace', 'opentelemetry.exporter')\n"
        "ours = sorted(m for m in sys.modules if m.startswith(bad))\n"
        "assert not ours, ours\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("traced", [True, False])
def test_the_lease_table_says_why_each_lease_ended(traced):
    from mooncake_vllm.p2p.leases.table import LeaseTable

    now = [0.0]
    table = LeaseTable(
        ttl_s=10.0, budget_bytes=1 << 30, pull_hold_s=5.0, clock=lambda: now[0],
        keep_reasons=traced,
    )  # fmt: skip
    table.add("req-a", "tid-a", [1, 2], 100)
    table.add("req-b", "tid-b", [3], 100)
    owner = b"o" * 16
    assert not isinstance(table.acquire("tid-a", [1, 2], owner), str)
    table.release("tid-a", owner, ok=False)
    now[0] = 11.0
    table.expire()
    if not traced:  # tracing off: nothing kept per request
        assert table.take_ended_reasons() == {}
        return
    assert table.take_ended_reasons() == {"req-a": "pull failed", "req-b": "expired"}
    assert table.take_ended_reasons() == {}  # taken: the dict stays bounded
