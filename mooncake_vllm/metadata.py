"""Where the transfer engine's segment metadata lives: parsing ``metadata_server`` and the stores.

The engine itself only ever sees ``P2PHANDSHAKE`` or an ``http://127.0.0.1:<port>/metadata`` URL
served by this process's ``MetadataBridge`` (``metadata_bridge``), which stores the keys in the
configured etcd, redis or http server. Why one path for every store:
- the PyPI wheels have no redis client, and reaching it aborts the process;
- a peer restarted under the same name must overwrite its old keys (Mooncake's own http server
  refuses that, and the engine hangs in ``initialize`` on stale etcd keys);
- a store outage must not break peers that already know each other (the bridge serves its cache);
- keys carry a TTL refreshed by a heartbeat, so a crashed engine's keys go away by themselves and
  a store that lost its data (restart) gets them back.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol
from urllib.parse import urlsplit

import aiohttp
from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
StoreKind = Literal["p2p", "etcd", "redis", "http"]

ACCEPTED_FORMS = (
    "'P2PHANDSHAKE', 'etcd://host:port' (several: 'etcd://h1:p1,h2:p2'), 'redis://host:port', "
    "'http://host:port/metadata', or a bare 'host:port' with metadata_backend 'etcd'|'redis'|'http'"
)


class MetadataAuth(BaseModel):
    """Credentials for the metadata store (``metadata_auth`` in the config). Secrets come from
    files or environment variables named here, never from the config or a command line."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class MetadataTarget:
    """A parsed ``metadata_server``: the kind of store and how to reach it."""

    kind: StoreKind
    # etcd: host:port endpoints; redis: one redis:// URL; http: one URL; p2p: none.
    endpoints: tuple[str, ...] = ()

    def describe(self) -> str:
        return P2P_HANDSHAKE if self.kind == "p2p" else f"{self.kind} {','.join(self.endpoints)}"


def split_host_port(value: str) -> tuple[str, int] | None:
    """``"host:port"`` → ``(host, port)``; None when it is not that (callers word the error)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _check_host_port(value: str, original: str) -> str:
    if split_host_port(value.strip()) is None:
        raise ValueError(f"metadata_server={original!r}: {value!r} is not 'host:port'")
    return value.strip()


def parse_metadata_server(server: str, backend: str | None = None) -> MetadataTarget:
    """``metadata_server`` (+ legacy ``metadata_backend``) → target; ValueError names the forms."""
    if server == P2P_HANDSHAKE:
        return MetadataTarget("p2p")
    scheme, sep, rest = server.partition("://")
    if not sep:  # legacy bare form: host:port[,host:port], interpreted with metadata_backend
        if backend is None and ":" not in server:
            raise ValueError(f"metadata_server={server!r}: accepted forms are {ACCEPTED_FORMS}")
        scheme, rest = backend or "etcd", server
        if scheme == "http":
            rest = f"{rest}/metadata"
    elif backend is not None and backend != scheme.removesuffix("s"):
        raise ValueError(
            f"metadata_backend={backend!r} contradicts metadata_server={server!r}; drop "
            "metadata_backend (the URL scheme says it) or make them agree"
        )
    if scheme == "etcd":
        parts = [p for p in rest.replace(";", ",").split(",") if p.strip()]
        if not parts:
            raise ValueError(f"metadata_server={server!r}: no etcd endpoint given")
        return MetadataTarget("etcd", tuple(_check_host_port(p, server) for p in parts))
    if scheme == "redis":
        _check_host_port(rest.split("/", 1)[0], server)
        return MetadataTarget("redis", (f"redis://{rest}",))
    if scheme in ("http", "https"):
        url = f"{scheme}://{rest}"
        if not urlsplit(url).hostname:
            raise ValueError(f"metadata_server={server!r}: no host in the URL")
        return MetadataTarget("http", (url,))
    raise ValueError(f"metadata_server={server!r}: accepted forms are {ACCEPTED_FORMS}")


# ---- stores -------------------------------------------------------------------------------------


class StoreUnavailable(RuntimeError):
    """The store could not be reached or answered with an error."""


class Store(Protocol):
    """An async key-value store; every method raises ``StoreUnavailable`` on failure."""

    async def ping(self) -> None: ...
    async def get(self, key: str) -> bytes | None: ...
    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None: ...
    async def delete(self, key: str) -> None: ...
    async def list(self, prefix: str) -> dict[str, bytes]: ...
    async def close(self) -> None: ...


_TIMEOUT = aiohttp.ClientTimeout(total=3.0)


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdStore:
    """etcd v3 through its JSON gateway (no client library); tries each endpoint in turn.

    A key with a TTL is attached to a lease granted for that TTL; the caller's heartbeat puts
    it again before the lease ends (each put gets a fresh lease, the old one lapses)."""

    def __init__(self, endpoints: tuple[str, ...]):
        self._endpoints = list(endpoints)
        self._session: aiohttp.ClientSession | None = None

    async def _post(self, path: str, body: dict) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT)
        errors = []
        for i, endpoint in enumerate(list(self._endpoints)):
            try:
                async with self._session.post(f"http://{endpoint}{path}", json=body) as resp:
                    data = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise StoreUnavailable(f"etcd {endpoint}{path}: HTTP {resp.status} {data}")
                    if i:  # remember the endpoint that answered
                        self._endpoints.insert(0, self._endpoints.pop(i))
                    return data
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
                errors.append(f"{endpoint}: {type(e).__name__}: {e}")
        raise StoreUnavailable("etcd unreachable (" + "; ".join(errors) + ")")

    async def ping(self) -> None:
        await self._post("/v3/maintenance/status", {})

    async def get(self, key: str) -> bytes | None:
        kvs = (await self._post("/v3/kv/range", {"key": _b64(key)})).get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if ttl_s is not None:
            lease = await self._post("/v3/lease/grant", {"TTL": max(1, round(ttl_s))})
            body["lease"] = lease["ID"]
        await self._post("/v3/kv/put", body)

    async def delete(self, key: str) -> None:
        await self._post("/v3/kv/deleterange", {"key": _b64(key)})

    async def list(self, prefix: str) -> dict[str, bytes]:
        raw = prefix.encode()
        range_end = raw[:-1] + bytes([raw[-1] + 1])  # every key that starts with prefix
        body = {"key": _b64(raw), "range_end": _b64(range_end)}
        kvs = (await self._post("/v3/kv/range", body)).get("kvs") or []
        return {
            base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
            for kv in kvs
        }

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class RedisStore:
    def __init__(self, url: str):
        import redis.asyncio as aioredis

        self._url = url
        self._redis = aioredis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)

    async def _do(self, what: str, coro):
        import redis.exceptions

        try:
            return await coro
        except (redis.exceptions.RedisError, OSError) as e:
            raise StoreUnavailable(f"redis {self._url} {what}: {type(e).__name__}: {e}") from e

    async def ping(self) -> None:
        await self._do("PING", self._redis.ping())

    async def get(self, key: str) -> bytes | None:
        return await self._do("GET", self._redis.get(key))

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        ex = max(1, round(ttl_s)) if ttl_s is not None else None
        await self._do("SET", self._redis.set(key, value, ex=ex))

    async def delete(self, key: str) -> None:
        await self._do("DEL", self._redis.delete(key))

    async def list(self, prefix: str) -> dict[str, bytes]:
        async def scan() -> dict[str, bytes]:
            pattern = "".join(f"[{c}]" if c in "*?[]\\" else c for c in prefix) + "*"
            keys = [k async for k in self._redis.scan_iter(match=pattern, count=1000)]
            values = await self._redis.mget(keys) if keys else []
            # A key that expired between SCAN and MGET reads as None: it is gone.
            return {k.decode(): v for k, v in zip(keys, values, strict=True) if v is not None}

        return await self._do("SCAN", scan())

    async def close(self) -> None:
        await self._redis.aclose()


class HttpStore:
    """An http metadata server speaking the engine's protocol: GET/PUT/DELETE ``url?key=``.

    ``ttl`` is sent as a query parameter (ours honours it; Mooncake's ignores it). Mooncake's
    server refuses to overwrite some keys, so a refused PUT is retried after a DELETE."""

    def __init__(self, url: str):
        self._url = url
        self._session: aiohttp.ClientSession | None = None

    async def _request(self, method: str, params: dict, data: bytes | None = None):
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT)
        try:
            async with self._session.request(method, self._url, params=params, data=data) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"http {self._url}: {type(e).__name__}: {e}") from e

    async def ping(self) -> None:
        status, body = await self._request("GET", {"key": "mooncake-vllm/ping"})
        if status not in (200, 404):
            raise StoreUnavailable(f"http {self._url}: GET answered {status} {body[:200]!r}")

    async def get(self, key: str) -> bytes | None:
        status, body = await self._request("GET", {"key": key})
        if status == 404:
            return None
        if status != 200:
            raise StoreUnavailable(f"http {self._url}: GET {key} answered {status}")
        return body

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        params = {"key": key} if ttl_s is None else {"key": key, "ttl": str(round(ttl_s))}
        status, body = await self._request("PUT", params, value)
        if status != 200:
            await self._request("DELETE", {"key": key})
            status, body = await self._request("PUT", params, value)
        if status != 200:
            raise StoreUnavailable(f"http {self._url}: PUT {key} answered {status} {body[:200]!r}")

    async def delete(self, key: str) -> None:
        status, _ = await self._request("DELETE", {"key": key})
        if status not in (200, 404):
            raise StoreUnavailable(f"http {self._url}: DELETE {key} answered {status}")

    async def list(self, prefix: str) -> dict[str, bytes]:
        """``GET url?prefix=P`` → ``{key: base64 value}``: our metadata server's extension
        (Mooncake's server does not list keys)."""
        status, body = await self._request("GET", {"prefix": prefix})
        try:
            listed = json.loads(body) if status == 200 else None
        except json.JSONDecodeError:
            listed = None
        if not isinstance(listed, dict):
            raise StoreUnavailable(
                f"http {self._url}: listing keys by prefix answered {status} {body[:200]!r}; "
                "discovery over http needs mooncake_vllm.metadata_server (Mooncake's http "
                "metadata server cannot list keys)"
            )
        return {k: base64.b64decode(v) for k, v in listed.items()}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class MemoryStore:
    """In-process store with TTLs and optional persistence (a JSON snapshot rewritten on change):
    the backing store of ``python -m mooncake_vllm.metadata_server``."""

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
            k: (_b64(v), None if exp is None else max(0.0, exp - now))
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


def open_store(target: MetadataTarget) -> Store:
    if target.kind == "etcd":
        return EtcdStore(target.endpoints)
    if target.kind == "redis":
        return RedisStore(target.endpoints[0])
    if target.kind == "http":
        return HttpStore(target.endpoints[0])
    raise ValueError(f"no store for {target.describe()}")
