"""An OTLP/HTTP trace receiver in the test's process (opentelemetry-proto's messages, no
collector), and helpers to read the trees it collects."""

from __future__ import annotations

import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from harness.servers import free_port


class Receiver:
    """An OTLP/HTTP trace receiver: ``POST /v1/traces`` with an ExportTraceServiceRequest."""

    def __init__(self, keep: bool = True) -> None:
        """``keep`` False: count the spans only (a benchmark's receiver)."""
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[dict] = []
        self.count = 0
        self.keep = keep
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                size = int(self.headers.get("Content-Length", "0"))
                msg = trace_service_pb2.ExportTraceServiceRequest.FromString(self.rfile.read(size))
                receiver.add(msg)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.port = free_port("127.0.0.1")
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def add(self, msg) -> None:
        if not self.keep:
            with self.lock:
                self.count += sum(
                    len(ss.spans) for rs in msg.resource_spans for ss in rs.scope_spans
                )
            return
        for resource_spans in msg.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    span = {
                        "name": s.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(),
                        "attributes": {a.key: _value(a.value) for a in s.attributes},
                        "error": s.status.code == 2,
                        "status_message": s.status.message,
                        "service": resource.get("service.name", ""),
                        "pid": resource.get("vllm.process_id"),
                    }
                    with self.lock:
                        self.spans.append(span)
                        self.count += 1

    def of_trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 30.0) -> list[dict]:
        """The spans of ``trace_id`` once every one of ``names`` is among them (or at the
        timeout: the caller's assertions then say what is missing)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.of_trace(trace_id)
            if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def traceparent() -> tuple[str, str, str]:
    """A W3C ``traceparent`` of a new trace: the header, its trace id, its span id (hex)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def one_span(spans: list[dict], name: str, parent: dict | None = None) -> dict:
    """The one span named ``name`` (under ``parent``, when given)."""
    found = [
        s
        for s in spans
        if s["name"] == name and (parent is None or s["parent"] == parent["span_id"])
    ]
    assert len(found) == 1, (name, [(s["name"], s["parent"], s["service"]) for s in spans])
    return found[0]
