"""The engine's metadata protocol over HTTP, served from any ``Store``; and the in-worker bridge.

The transfer engine's http metadata client speaks ``GET/PUT/DELETE <url>?key=<key>`` (404 when
absent). ``metadata_app`` serves that from a store; ``python -m mooncake_vllm.transfer.http_store``
runs it over a ``MemoryStore``, and each worker's bridge process (``MetadataBridge``) runs it
over the configured etcd/redis/http store, with a cache and a heartbeat (see ``stores``).
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
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from typing import Protocol

from aiohttp import web

from mooncake_vllm.core import os_threads
from mooncake_vllm.transfer.stores import (
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
    kv: KeyValue, path: str = "/metadata", token: str | None = None
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

    middlewares = [require_token] if token else []
    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=middlewares)
    app.router.add_get(path, get)
    app.router.add_put(path, put)
    app.router.add_delete(path, delete)
    app.router.add_get("/health", health)
    return app


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
    target: MetadataTarget, ttl_s: float, parent_pid: int, auth: MetadataAuth | None = None
) -> None:
    """Body of the bridge process: ping the store, serve, heartbeat; on SIGTERM/SIGINT or when
    the parent (the worker) is gone, delete the keys this engine owned and return."""
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
    runner = web.AppRunner(metadata_app(kv), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(f"READY http://127.0.0.1:{runner.addresses[0][1]}/metadata", flush=True)
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
    ):
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
        self.url = first.split(" ", 1)[1].strip()
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
    """Started by ``MetadataBridge``: reads ``{"kind", "endpoints", "tls", "auth"}`` as one JSON
    line on stdin, then says ``READY <url>`` or ``ERROR <why>`` on stdout."""
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
    asyncio.run(serve_bridge(target, args.ttl_s, args.parent_pid, auth))


if __name__ == "__main__":
    main()
