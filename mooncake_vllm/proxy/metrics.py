"""Prometheus metrics of one proxy app, on its own registry (two apps in one process stay apart)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Prefill of a long prompt on CPU takes seconds; keep buckets up to the default prefill timeout.
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mooncake_proxy_requests",
            "Client requests by endpoint and the HTTP status the client got.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "mooncake_proxy_prefill_seconds",
            "Prefill leg: from sending the request to having the prefill's whole answer.",
            ["backend"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.first_decode_byte_seconds = Histogram(
            "mooncake_proxy_time_to_first_decode_byte_seconds",
            "From the client's request arriving to the first byte of the decode's answer body.",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "mooncake_proxy_backend_in_flight",
            "Requests the proxy has outstanding on a backend.",
            ["role", "backend"],
            registry=self.registry,
        )
        self.backend_errors = Counter(
            "mooncake_proxy_backend_errors",
            "Failed backend calls by kind: connect, disconnect, timeout, http_5xx, bad_answer, "
            "draining (refused because it is shutting down; sent to another backend).",
            ["role", "backend", "kind"],
            registry=self.registry,
        )
        self.ejections = Counter(
            "mooncake_proxy_backend_ejections",
            "Times a healthy backend was taken out of rotation.",
            ["role", "backend"],
            registry=self.registry,
        )
        self.missing_handoff = Counter(
            "mooncake_proxy_missing_kv_transfer_params",
            "Prefill answers without kv_transfer_params; the decode then computed the prompt.",
            ["backend"],
            registry=self.registry,
        )
        self.client_limited = Counter(
            "mooncake_proxy_client_limited",
            "Client requests refused with 429, by limit: concurrency (--client-max-concurrency) "
            "or rate (--client-rate).",
            ["reason"],
            registry=self.registry,
        )
        self.registry_records_ignored = Counter(
            "mooncake_proxy_registry_records_ignored",
            "Registry records ignored by --discover, once per key each time it turns bad: "
            "unsigned or bad_signature (under --auth-secret-*), invalid (no usable record).",
            ["reason"],
            registry=self.registry,
        )
        self.dispatched = Counter(
            "mooncake_proxy_dispatched",
            "Decode legs by how they were sent. Any dispatch: local (no prefill could take "
            "the request, every one down or draining: the decode got it as a plain request and "
            "computed the prompt itself), reloaded (the decode's KV load failed before a "
            "token, its prefill gone: both legs were sent again). Under --dispatch concurrent: "
            "concurrent (with the prefill leg), sequential (the prefill's side channel was not "
            "known yet), queued (sequential: the prefill was expected to answer later than "
            "--concurrent-max-wait-s), resent (the prefill handed over from another producer "
            "than the one awaited).",
            ["how"],
            registry=self.registry,
        )
        self.kv_events_dropped = Counter(
            "mooncake_proxy_kv_events_dropped",
            "KV events (--kv-events) dropped by the proxy, per engine, by reason: unreadable "
            "(a whole message), invalid (an event with wrong fields), unknown_type, failed "
            "(applying it raised), disconnected (the connection lost: the engine stopped or "
            "sent a message over 16 MiB; subscribed again). All but unknown_type clear that "
            "engine's part of the index.",
            ["backend", "reason"],
            registry=self.registry,
        )
        self._in_flight_children: dict[tuple[str, str], Gauge] = {}
        self._prefill_children: dict[str, Histogram] = {}
        for how in ("local", "reloaded", "concurrent", "sequential", "queued", "resent"):
            self.dispatched.labels(how)
        for reason in ("concurrency", "rate"):
            self.client_limited.labels(reason)
        for reason in ("unsigned", "bad_signature", "invalid"):
            self.registry_records_ignored.labels(reason)

    def in_flight_of(self, role: str, url: str) -> Gauge:
        """``in_flight``'s child for one backend, kept: ``labels()`` per call showed up in the
        proxy's profile."""
        child = self._in_flight_children.get((role, url))
        if child is None:
            child = self._in_flight_children[role, url] = self.in_flight.labels(role, url)
        return child

    def prefill_seconds_of(self, url: str) -> Histogram:
        """``prefill_seconds``' child for one prefill, kept (as ``in_flight_of``)."""
        child = self._prefill_children.get(url)
        if child is None:
            child = self._prefill_children[url] = self.prefill_seconds.labels(url)
        return child

    def declare_backends(self, role: str, urls: Iterable[str]) -> None:
        """Export zeros for every backend so dashboards see them before the first event."""
        for url in urls:
            self.in_flight.labels(role, url).set(0)
            self.ejections.labels(role, url)
            if role == "prefill":
                self.prefill_seconds.labels(url)
                self.missing_handoff.labels(url)

    def render(self) -> bytes:
        return generate_latest(self.registry)
