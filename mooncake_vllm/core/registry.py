"""The engine registry in the metadata store: what each engine publishes about itself.

``EngineRecord`` (per TP rank: role, side channel, transfer-engine segment, compat hash), read
by consumers that look a producer up by engine id; ``ServingRecord`` (per engine: its OpenAI URL),
read by ``proxy_server.py --discover``. With a shared secret both are signed (``auth``).
"""

from __future__ import annotations

import msgspec

REGISTRY_VERSION = 1


class EngineRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What each connector worker publishes in the metadata store under ``registry_key``."""

    version: int = REGISTRY_VERSION
    engine_id: str
    role: str
    tp_rank: int
    tp_size: int
    side_channel: str  # host:port; "" on a consumer (it serves no side channel)
    te_segment: str
    compat_hash: str


def registry_key(engine_id: str, tp_rank: int) -> str:
    return f"mooncake-vllm/engines/{engine_id}/{tp_rank}"


def encode_record(record: EngineRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_record(data: bytes) -> EngineRecord:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on a malformed record."""
    return msgspec.json.decode(data, type=EngineRecord)


class ServingRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Where an engine serves the OpenAI API, published beside its ``EngineRecord`` (by TP
    rank 0, one per engine) under ``serving_key``: what ``proxy_server.py --discover`` reads."""

    version: int = REGISTRY_VERSION
    engine_id: str
    role: str  # kv_producer → prefill pool, kv_consumer → decode pool, kv_both → both
    url: str  # http(s)://host:port, no path
    compat_hash: str


SERVING_PREFIX = "mooncake-vllm/serving/"


def serving_key(engine_id: str) -> str:
    return f"{SERVING_PREFIX}{engine_id}"


def encode_serving(record: ServingRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_serving(data: bytes) -> ServingRecord:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on a malformed record."""
    return msgspec.json.decode(data, type=ServingRecord)
