"""The engine's metadata protocol over HTTP, served from any ``Store``; and the in-worker bridge.

The transfer engine's http metadata client speaks ``GET/PUT/DELETE <url>?key=<key>`` (404 when
absent). ``metadata_app`` serves that from a store; ``python -m mooncake_vllm.transfer.http_store``
runs it over a ``MemoryStore``, and each worker's bridge process (``MetadataBridge``) runs it
over the configured etcd/redis/http store, with a cache and a heartbeat (see ``stores``).

The bridge holds the engine's store credentials, and any local user can reach 127.0.0.1, so it
serves only its own engine: its URL carries a secret made at its start
(``http://127.0.0.1:PORT/<secret>/metadata``, the only thing the C++ client can carry: it appends
``?key=`` to the URL it was given), handed to the worker over a pipe; and it passes on only the
keys of its engine's ``KeyScope``. Anything else is answered 403, counted and logged at most
every ``REFUSAL_LOG_PERIOD_S``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from mooncake_vllm.core import os_threads
from mooncake_vllm.core.registry import registry_key, serving_key
from mooncake_vllm.metadata import (
    MetadataAuth,
    MetadataTarget,
    Store,
    StoreUnavailable,
    check_auth,
    open_store,
)

logger = logging.getLogger(__name__)


class KeyValue(Protocol):
    async def get(self, key: str) -> bytes | None: ...
    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None: ...
    async def delete(self, key: str) -> None: ...
    async def list(self, prefix: str) -> dict[str, bytes]: ...


def metadata_app(
    kv: KeyValue,
    path: str = "/metadata",
    token: str | None = None,
    middlewares: Iterable[Callable] = (),
) -> web.Application:
    """The engine's http metadata protocol (plus ``ttl`` seconds on PUT, ``GET ?prefix=P`` listing
    ``{key: base64 value}`` for discovery, and ``GET /health``).

    With ``token``, every request but ``GET /health`` must carry ``Authorization: Bearer
    <token>`` and is answered 401 otherwise (the health check says nothing about the keys)."""

    def key_of(request: web.Request) -> str:
        key = request.query.get("key")
        if not key:
            raise web.HTTPBadRequest(text="missing ?key=")
        return key

    async def get(request: web.Request) -> web.Response:
        prefix = request.query.get("prefix")
        if prefix is not None and "key" not in request.query:  # list: {key: base64 value}
            try:
                listed = await kv.list(prefix)
            except StoreUnavailable as e:
                return web.Response(status=503, text=str(e))
            return web.json_response({k: base64.b64encode(v).decode() for k, v in listed.items()})
        try:
            value = await kv.get(key_of(request))
        except StoreUnavailable as e:
            return web.Response(status=503, text=str(e))
        if value is None:
            return web.Response(status=404, text="not found")
        return web.Response(body=value, content_type="application/json")

    async def put(request: web.Request) -> web.Response:
        key, ttl = key_of(request), request.query.get("ttl")
        try:
            ttl_s = float(ttl) if ttl else None
        except ValueError:
            return web.Response(status=400, text=f"ttl={ttl!r} is not a number of seconds")
        try:
            await kv.put(key, await request.read(), ttl_s)
        except StoreUnavailable as e:
            return web.Response(status=503, text=str(e))
        return web.Response(text="ok")

    async def delete(request: web.Request) -> web.Response:
        try:
            await kv.delete(key_of(request))
        except StoreUnavailable as e:
            return web.Response(status=503, text=str(e))
        return web.Response(text="ok")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @web.middleware
    async def require_token(request: web.Request, handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {token}"
        if request.path != "/health" and not hmac.compare_digest(given.encode(), expected.encode()):
            return web.Response(
                status=401,
                text="missing or wrong bearer token (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": 'Bearer realm="metadata"'},
            )
        return await handler(request)

    checks = [require_token] if token else []
    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[*middlewares, *checks])
    app.router.add_get(path, get)
    app.router.add_put(path, put)
    app.router.add_delete(path, delete)
    app.router.add_get("/health", health)
    return app


# The keys the transfer engine reads and writes (Mooncake's transfer_metadata.cpp): a segment's
# descriptor and its RPC address, both named by the segment (the hostname it was initialized
# with, ``host:port``).
TE_SEGMENT_PREFIX = "mooncake/ram/"
TE_RPC_META_PREFIX = "mooncake/rpc_meta/"
# Where every engine's registry records live (``registry_key``): a consumer reads a producer's.
ENGINES_PREFIX = registry_key("", 0).removesuffix("/0")


@dataclass(frozen=True)
class KeyScope:
    """The keys one engine's bridge passes on to the store.

    PUT and DELETE: only ``own`` (the engine's segment, its RPC address, its registry and
    serving records). GET: those and any key under ``readable_prefixes``, which the engine
    reads to reach its peers (their segments, RPC addresses and registry records). Listing
    (``GET ?prefix=``) never: the engine does not list, discovery reads the store itself."""

    own: frozenset[str]
    readable_prefixes: tuple[str, ...] = (TE_SEGMENT_PREFIX, TE_RPC_META_PREFIX, ENGINES_PREFIX)

    @classmethod
    def for_engine(cls, engine_id: str, tp_rank: int, segment: str) -> KeyScope:
        """The scope of TP rank ``tp_rank`` of ``engine_id``, whose transfer engine was
        initialized with hostname ``segment``."""
        return cls(
            frozenset(
                {
                    TE_SEGMENT_PREFIX + segment,
                    TE_RPC_META_PREFIX + segment,
                    registry_key(engine_id, tp_rank),
                    serving_key(engine_id),
                }
            )
        )

    def may_write(self, key: str) -> bool:
        return key in self.own

    def may_read(self, key: str) -> bool:
        return key in self.own or key.startswith(self.readable_prefixes)


# How often, at most, the bridge logs the requests it refused (a local process hammering it
# must not fill the worker's log); each line says how many were refused since the last.
REFUSAL_LOG_PERIOD_S = 10.0


class Refusals:
    """The requests a bridge refused, by reason (``no_secret``, ``foreign_key``, ``listing``),
    logged at most every ``period_s``: the first at once, later ones summed into the next line."""

    def __init__(
        self,
        period_s: float = REFUSAL_LOG_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.counts: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._period_s = period_s
        self._clock = clock
        self._next_log = float("-inf")

    def refuse(self, reason: str, what: str) -> web.Response:
        self.counts[reason] += 1
        self._unlogged[reason] += 1
        now = self._clock()
        if now >= self._next_log:
            logger.warning(
                "metadata bridge refused %s (403); refused since the last report: %s",
                what,
                dict(self._unlogged),
            )
            self._unlogged.clear()
            self._next_log = now + self._period_s
        return web.Response(status=403, text=f"refused: {what}")


def bridge_app(
    kv: KeyValue, secret: str, scope: KeyScope, refusals: Refusals | None = None
) -> web.Application:
    """``metadata_app`` at ``/<secret>/metadata``, passing on only ``scope``'s keys; every
    other request (another path, no secret, a foreign key, a listing) is answered 403."""
    path = f"/{secret}/metadata"
    refusals = refusals or Refusals()

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        if not hmac.compare_digest(request.path.encode(), path.encode()):
            return refusals.refuse("no_secret", f"{request.method} without the bridge's secret")
        key = request.query.get("key")
        if key is None:
            if request.method == "GET" and "prefix" in request.query:
                return refusals.refuse("listing", "a listing (the engine never lists)")
            return await handler(request)  # answered 400 (missing ?key=)
        allowed = scope.may_read(key) if request.method == "GET" else scope.may_write(key)
        if not allowed:
            shown = key if len(key) <= 200 else f"{key[:200]}..."
            return refusals.refuse(
                "foreign_key", f"{request.method} of {shown!r}, not this engine's key"
            )
        return await handler(request)

    return metadata_app(kv, path=path, middlewares=[guard])


class MetadataUnavailable(RuntimeError):
    """The configured metadata store cannot be used (raised at startup)."""


class _CachedStore:
    """What the bridge serves: the store, with a bounded cache of every value seen for reads
    while the store is away, and the keys this process owns, re-put with a TTL by a heartbeat."""

    def __init__(self, store: Store, ttl_s: float, cache_entries: int = 4096):
        self.store = store
        self.ttl_s = ttl_s
        self.owned: dict[str, bytes] = {}
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cache_entries = cache_entries
        self.store_ok = True

    def _remember(self, key: str, value: bytes) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)

    def _lost(self, e: StoreUnavailable) -> None:
        if self.store_ok:
            logger.warning("metadata store unreachable, serving cached metadata: %s", e)
        self.store_ok = False

    async def get(self, key: str) -> bytes | None:
        try:
            value = await self.store.get(key)
        except StoreUnavailable as e:
            self._lost(e)
            cached = self.owned.get(key) or self._cache.get(key)
            if cached is None:
                raise
            return cached
        if value is not None:
            self._remember(key, value)
        return value

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        # Owned keys live while this process does: always with our TTL, whatever was asked.
        self.owned[key] = value
        self._remember(key, value)
        try:
            await self.store.put(key, value, self.ttl_s)
        except StoreUnavailable as e:
            self._lost(e)  # the heartbeat publishes it once the store is back

    async def delete(self, key: str) -> None:
        self.owned.pop(key, None)
        self._cache.pop(key, None)
        try:
            await self.store.delete(key)
        except StoreUnavailable as e:
            self._lost(e)  # an owned key expires by its TTL anyway

    async def list(self, prefix: str) -> dict[str, bytes]:
        return await self.store.list(prefix)  # no cache: a listing must be current

    async def heartbeat(self) -> None:
        try:
            for key, value in list(self.owned.items()):
                await self.store.put(key, value, self.ttl_s)
        except StoreUnavailable as e:
            self._lost(e)
            return
        if not self.store_ok:
            logger.warning("metadata store is back; republished %d keys", len(self.owned))
        self.store_ok = True


async def serve_bridge(
    target: MetadataTarget,
    ttl_s: float,
    parent_pid: int,
    scope: KeyScope,
    auth: MetadataAuth | None = None,
) -> None:
    """Body of the bridge process: ping the store, serve ``scope``'s keys at a secret URL,
    heartbeat; on SIGTERM/SIGINT or when the parent (the worker) is gone, delete the keys this
    engine owned and return."""
    try:
        kv = _CachedStore(open_store(target, auth), ttl_s)
    except ValueError as e:  # credentials that do not fit the store, or a file gone since
        print(f"ERROR {e}", flush=True)
        return
    try:
        await kv.store.ping()
    except StoreUnavailable as e:
        print(f"ERROR {e}", flush=True)
        await kv.store.close()
        return
    # The secret reaches only the worker (over our stdout pipe) and its transfer engine.
    secret = secrets.token_urlsafe(32)
    runner = web.AppRunner(bridge_app(kv, secret, scope), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(f"READY http://127.0.0.1:{runner.addresses[0][1]}/{secret}/metadata", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C reaches the worker's whole group
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    period_s, next_beat = max(0.5, ttl_s / 3), time.monotonic()
    while not stop.is_set() and os.getppid() == parent_pid:
        if time.monotonic() >= next_beat:
            await kv.heartbeat()
            next_beat = time.monotonic() + period_s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    for key in list(kv.owned):
        await kv.delete(key)
    await runner.cleanup()
    await kv.store.close()


class MetadataBridge:
    """The worker's handle on its bridge process (one per transfer engine).

    A process, not a thread: the engine's blocking calls (``initialize``) hold the GIL while
    they wait for the metadata server, so a bridge in the same interpreter would deadlock them.
    """

    def __init__(
        self,
        target: MetadataTarget,
        ttl_s: float = 30.0,
        start_timeout_s: float = 20.0,
        auth: MetadataAuth | None = None,
        *,
        scope: KeyScope,
    ):
        """``scope``: the keys this engine may write and read (``KeyScope.for_engine``)."""
        self.target = target
        auth = auth or MetadataAuth()
        try:
            check_auth(target, auth)
        except ValueError as e:
            raise MetadataUnavailable(
                f"metadata_server ({target.describe()}) cannot be used: {e}"
            ) from None
        argv = [
            sys.executable,
            "-m",
            "mooncake_vllm.transfer.store_bridge",
            "--ttl-s",
            str(ttl_s),
            "--parent-pid",
            str(os.getpid()),
            "--thread-priority",
            os_threads.policy(),
        ]
        # The store's address goes over stdin, not argv: a URL may carry a password, and any
        # user can read a process's arguments. The credentials are the names of files and
        # variables (the environment is inherited). stderr is inherited: the bridge's warnings
        # land in the worker's log.
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        spec = {
            "kind": target.kind,
            "endpoints": list(target.endpoints),
            "tls": target.tls,
            "auth": auth.model_dump(exclude_none=True),
            "own": sorted(scope.own),
            "readable_prefixes": list(scope.readable_prefixes),
        }
        assert self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.write(json.dumps(spec) + "\n")
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.close()
        first = _read_line(self._proc, start_timeout_s)
        if not first.startswith("READY "):
            self.close()
            raise MetadataUnavailable(
                f"metadata_server ({target.describe()}) cannot be used: "
                f"{first.removeprefix('ERROR ').strip() or 'the bridge did not start'}. Start "
                "the server, fix metadata_server (or metadata_auth), or use 'P2PHANDSHAKE' (no "
                "metadata server)"
            )
        self.url = first.split(" ", 1)[1].strip()  # holds the secret: never log it
        self._closing = False
        self.death: str | None = None  # why the bridge process is gone, once it is
        threading.Thread(target=self._watch, name="mooncake-bridge-watch", daemon=True).start()

    def _watch(self) -> None:
        """Waits (blocking, no polling) for the bridge process; an exit before ``close`` is
        logged with its cause, and every later store operation fails with it."""
        code = self._proc.wait()
        if self._closing:
            return
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        self.death = (
            f"the metadata bridge process (pid {self._proc.pid}) for metadata_server "
            f"{self.target.describe()} ended with {how} (its stderr is in this log above); the "
            "transfer engine can no longer publish or look up metadata. Restart this vLLM"
        )
        logger.error("%s", self.death)

    def _request(self, method: str, key: str, data: bytes | None, timeout_s: float):
        if self.death is not None:
            raise StoreUnavailable(self.death)
        url = f"{self.url}?{urllib.parse.urlencode({'key': key})}"
        req = urllib.request.Request(url, data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise StoreUnavailable(f"metadata bridge {method} {key}: HTTP {e.code}") from e
        except OSError as e:
            raise StoreUnavailable(f"metadata bridge {method} {key}: {e}") from e

    def publish(self, key: str, value: bytes, timeout_s: float = 5.0) -> None:
        """Own ``key`` while this engine lives (TTL + heartbeat; re-put when the store returns)."""
        self._request("PUT", key, value, timeout_s)

    def lookup(self, key: str, timeout_s: float = 5.0) -> bytes | None:
        """Raises ``StoreUnavailable`` when the store is away and the key was never seen."""
        return self._request("GET", key, None, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the bridge; it deletes the keys this engine owned first."""
        self._closing = True
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("metadata bridge did not stop in %.0fs; killing it", timeout_s)
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The process's first stdout line, or "" if it exits or says nothing in time."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


def main(argv: list[str] | None = None) -> None:
    """Started by ``MetadataBridge``: reads ``{"kind", "endpoints", "tls", "auth", "own",
    "readable_prefixes"}`` as one JSON line on stdin, then says ``READY <url>`` or ``ERROR
    <why>`` on stdout."""
    parser = argparse.ArgumentParser(description="metadata bridge (started by the connector)")
    parser.add_argument("--ttl-s", type=float, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument(
        "--thread-priority", required=True, choices=os_threads.POLICIES,
        help="the worker's thread_priority policy",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s mooncake-metadata %(message)s")
    # The heartbeat keeps this engine's keys and registry record alive (TTL metadata_ttl_s): it
    # mostly sleeps and must run when it wakes, also beside engines that start at a higher
    # priority (seen: a 4 s record lapsing while two vLLMs started at nice -10 beside it).
    # Threads started later (the loop's executor) inherit the priority.
    os_threads.set_policy(args.thread_priority)
    os_threads.name_this_thread("mc-metadata")
    os_threads.make_latency_critical()
    spec = json.loads(sys.stdin.readline())
    target = MetadataTarget(spec["kind"], tuple(spec["endpoints"]), spec["tls"])
    try:
        auth = MetadataAuth(**spec["auth"])
    except ValueError as e:  # a file or variable that went away since the worker checked it
        print(f"ERROR metadata_auth: {e}", flush=True)
        return
    scope = KeyScope(frozenset(spec["own"]), tuple(spec["readable_prefixes"]))
    asyncio.run(serve_bridge(target, args.ttl_s, args.parent_pid, scope, auth))


if __name__ == "__main__":
    main()
