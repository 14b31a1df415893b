"""OpenTelemetry spans of ours, off unless an OTLP endpoint is given.

The proxy's ``--otlp-traces-endpoint`` and vLLM's own (read from the engine's config by the
connector) turn them on. Off, nothing of OpenTelemetry is imported and every call here returns
at its first line. On, spans go out by OTLP/HTTP (protobuf) through the SDK's batch processor, as
vLLM's do when ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``; the trace context comes from
a request's W3C ``traceparent`` header (``TRACE_HEADERS``), the same header vLLM reads.

Spans are written after the fact with the times measured (``record``): the code that measures
stays free of tracing calls, and a span costs nothing on the path it describes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
TRACE_HEADER_BYTES = tuple(name.encode() for name in TRACE_HEADERS)  # as ASGI names them
# A longer value is not a trace context (traceparent is 55 characters): it is not carried.
MAX_TRACE_HEADER = 1024
# The service names our spans carry: the proxy's, and the connector's in an engine's processes.
PROXY_SERVICE = "mooncake-vllm-proxy"
CONNECTOR_SERVICE = "mooncake-vllm-connector"
# A span's attributes are strings, numbers or booleans: longer strings are cut here.
MAX_ATTRIBUTE_CHARS = 512

_lock = threading.Lock()
_tracers: dict[tuple[str, str], tuple[Any, Any]] = {}  # (endpoint, service) -> provider, tracer


def trace_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The W3C trace-context headers among ``headers`` (any case), as they were."""
    if not headers:
        return {}
    out = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower in TRACE_HEADERS and isinstance(value, str) and len(value) <= MAX_TRACE_HEADER:
            out[lower] = value
    return out


PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # the SDK's, which vLLM reads too


def tracer(endpoint: str | None, service: str, default_protocol: str = "http/protobuf") -> Any:
    """The tracer exporting to ``endpoint`` as ``service`` (one per pair, made once), or None
    when ``endpoint`` is None: then nothing of OpenTelemetry is imported. The protocol is
    ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (``grpc`` or ``http/protobuf``), else
    ``default_protocol`` (the connector passes vLLM's default, ``grpc``, so that both export to
    the endpoint vLLM was given the same way)."""
    if not endpoint:
        return None
    protocol = os.environ.get(PROTOCOL_ENV) or default_protocol
    with _lock:
        found = _tracers.get((endpoint, service))
        if found is not None:
            return found[1]
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[no-redef]
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter(endpoint=endpoint)
        else:
            raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: use grpc or http/protobuf")
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        made = provider.get_tracer("mooncake_vllm")
        _tracers[(endpoint, service)] = (provider, made)
        logger.info("OpenTelemetry spans of %s go to %s", service, endpoint)
        return made


def shutdown() -> None:
    """Flush and stop every tracer made here (a process's last spans)."""
    with _lock:
        made = list(_tracers.values())
        _tracers.clear()
    for provider, _ in made:
        provider.shutdown()


def now_ns() -> int:
    return time.time_ns()


@dataclass
class Span:
    """A span measured elsewhere: its name, wall-clock times (ns since the epoch), attributes,
    an error (the span's status) and its children."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    children: list[Span] = field(default_factory=list)

    def child(self, name: str, start_ns: int, end_ns: int, **attributes: Any) -> Span:
        span = Span(name, start_ns, end_ns, dict(attributes))
        self.children.append(span)
        return span


def _attributes(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool | int | float):
            out[key] = value
        else:
            out[key] = str(value)[:MAX_ATTRIBUTE_CHARS]
    return out


def record(
    t: Any, span: Span, parent_headers: Mapping[str, str] | None, kind: str = "INTERNAL"
) -> None:
    """Export ``span`` and its children through tracer ``t`` under the trace context of
    ``parent_headers`` (none: a trace of its own). Never raises: a span that cannot be written
    is logged and dropped."""
    if t is None:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(dict(parent_headers or {}))
        _write(t, trace, span, parent, getattr(trace.SpanKind, kind))
    except Exception:  # a trace is never worth a failed request
        logger.exception("span %s not written", span.name)


def _write(t: Any, trace: Any, span: Span, parent: Any, kind: Any) -> None:
    otel = t.start_span(
        span.name,
        context=parent,
        kind=kind,
        attributes=_attributes(span.attributes),
        start_time=span.start_ns,
    )
    if span.error is not None:
        otel.set_status(trace.Status(trace.StatusCode.ERROR, span.error[:MAX_ATTRIBUTE_CHARS]))
    inner = trace.set_span_in_context(otel, parent)
    for c in span.children:
        _write(t, trace, c, inner, trace.SpanKind.INTERNAL)
    otel.end(end_time=max(span.end_ns, span.start_ns))


def start(t: Any, name: str, parent_headers: Mapping[str, str] | None, kind: str,
          attributes: Mapping[str, Any] | None = None) -> Any:  # fmt: skip
    """A live span (the proxy's request and legs, whose end is not known yet), or None when
    ``t`` is None. End it with ``end``; inject its context with ``headers_of``."""
    if t is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(dict(parent_headers or {}))
    return t.start_span(name, context=parent, kind=getattr(trace.SpanKind, kind),
                        attributes=_attributes(attributes or {}))  # fmt: skip


def headers_of(span: Any) -> dict[str, str]:
    """The ``traceparent`` (and ``tracestate``) that make a callee's spans children of
    ``span``; {} for None."""
    if span is None:
        return {}
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier


def end(span: Any, error: str | None = None, **attributes: Any) -> None:
    """End a live span from ``start`` (None: nothing), with its status and last attributes."""
    if span is None:
        return
    try:
        from opentelemetry import trace

        for key, value in _attributes(attributes).items():
            span.set_attribute(key, value)
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error[:MAX_ATTRIBUTE_CHARS]))
        span.end()
    except Exception:
        logger.exception("span not ended")
