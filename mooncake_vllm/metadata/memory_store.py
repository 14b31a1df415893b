"""An in-process store with TTLs and optional persistence."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

from mooncake_vllm.metadata.base import b64


class MemoryStore:
    """In-process store with TTLs and optional persistence (a JSON snapshot rewritten on change):
    the backing store of ``python -m mooncake_vllm.transfer.http_store``."""

    def __init__(self, persist_path: Path | None = None):
        self._data: dict[str, tuple[bytes, float | None]] = {}  # key -> (value, expiry monotonic)
        self._path = persist_path
        if persist_path is not None and persist_path.exists():
            saved = json.loads(persist_path.read_text())
            # TTLs restart from the snapshot's load: owners re-put within their heartbeat.
            self._data = {
                k: (base64.b64decode(v), None if ttl is None else time.monotonic() + ttl)
                for k, (v, ttl) in saved.items()
            }

    def _live(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] is not None and item[1] < time.monotonic():
            del self._data[key]
            return None
        return item[0]

    def _save(self) -> None:
        if self._path is None:
            return
        now = time.monotonic()
        snapshot = {
            k: (b64(v), None if exp is None else max(0.0, exp - now))
            for k, (v, exp) in self._data.items()
        }
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snapshot))
        tmp.replace(self._path)

    async def ping(self) -> None:
        return

    async def get(self, key: str) -> bytes | None:
        return self._live(key)

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        self._data[key] = (value, None if ttl_s is None else time.monotonic() + ttl_s)
        self._save()

    async def delete(self, key: str) -> None:
        if self._data.pop(key, None) is not None:
            self._save()

    async def list(self, prefix: str) -> dict[str, bytes]:
        keys = [k for k in self._data if k.startswith(prefix)]
        return {k: v for k in keys if (v := self._live(k)) is not None}

    async def close(self) -> None:
        return
