"""Where each prefill's side channel is, learnt from its handoffs: what ``--dispatch concurrent``
puts in a decode leg's pending handoff (``proxy.concurrent``)."""

from __future__ import annotations

from typing import Any

# What a pending handoff takes from a producer's handoff: where and who the producer is.
PRODUCER_FIELDS = (
    "producer_engine_id",
    "side_channel_host",
    "side_channel_ports",
    "producer_tp_size",
)


class Producers:
    """Where each prefill's side channel is, from the handoffs it returned (by backend URL)."""

    def __init__(self) -> None:
        self._by_url: dict[str, dict[str, Any]] = {}

    def learn(self, url: str, handoff: dict[str, Any] | None) -> None:
        producer = producer_of(handoff)
        if producer is None:
            self._by_url.pop(url, None)  # it hands over no more (or names no side channel)
        else:
            self._by_url[url] = producer

    def get(self, url: str) -> dict[str, Any] | None:
        return self._by_url.get(url)


def producer_of(handoff: dict[str, Any] | None) -> dict[str, Any] | None:
    """The producer fields of a prefill's handoff; None if it names no side channel (the
    consumer looks such a producer up in the registry: it cannot wait on it pending)."""
    if not handoff or not handoff.get("side_channel_host"):
        return None
    if not all(k in handoff for k in PRODUCER_FIELDS):
        return None
    return {k: handoff[k] for k in PRODUCER_FIELDS}
