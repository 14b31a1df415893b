"""The worker's metadata bridge serves its own engine only: hostile local requests (no vLLM).

The bridge holds the engine's store credentials on 127.0.0.1, where any local user can reach
it. Before: a PUT refused by an authenticated store (401) went through the bridge (200) and the
heartbeat kept republishing it. Now the bridge's URL carries a per-start secret and only the
engine's own keys pass (``KeyScope``); the rest is answered 403, counted and logged rarely.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import urllib.error
import urllib.request

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from mooncake_vllm.core.registry import registry_key, serving_key
from mooncake_vllm.metadata import (
    MemoryStore,
    MetadataAuth,
    MetadataTarget,
    StoreUnavailable,
)
from mooncake_vllm.transfer.store_bridge import (
    KeyScope,
    MetadataBridge,
    Refusals,
    _CachedStore,
    bridge_app,
    metadata_app,
)

SEGMENT = "127.0.0.2:13003"
SCOPE = KeyScope.for_engine("prefill-a", 0, SEGMENT)
OWN_SEGMENT = f"mooncake/ram/{SEGMENT}"
PEER_SEGMENT = "mooncake/ram/127.0.0.3:14003"
SECRET = "s3cret-per-start"
TOKEN = "store-token-for-tests"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_scope_owns_the_engines_keys_and_reads_its_peers():
    assert SCOPE.own == {
        OWN_SEGMENT,
        f"mooncake/rpc_meta/{SEGMENT}",
        registry_key("prefill-a", 0),
        serving_key("prefill-a"),
    }
    assert not SCOPE.may_write(PEER_SEGMENT)
    assert not SCOPE.may_write(registry_key("prefill-b", 0))
    assert SCOPE.may_read(PEER_SEGMENT)
    assert SCOPE.may_read("mooncake/rpc_meta/127.0.0.3:14003")
    assert SCOPE.may_read(registry_key("prefill-b", 1))  # a consumer looks a producer up
    assert not SCOPE.may_read(serving_key("prefill-b"))  # the proxy's, not the engine's
    assert not SCOPE.may_read("other-app/config")


@pytest.fixture
async def bridge():
    store = MemoryStore()
    refusals = Refusals(clock=FakeClock())
    app = bridge_app(_CachedStore(store, ttl_s=30), SECRET, SCOPE, refusals)
    async with (
        TestServer(app, host="127.0.0.1") as server,
        aiohttp.ClientSession(str(server.make_url(""))) as session,
    ):
        yield session, store, refusals


@pytest.mark.parametrize(
    ("method", "path", "params"),
    [
        ("PUT", "/metadata", {"key": OWN_SEGMENT}),  # the URL the bridge served before
        ("GET", "/metadata", {"key": PEER_SEGMENT}),
        ("DELETE", "/metadata", {"key": OWN_SEGMENT}),
        ("GET", "/metadata", {"prefix": ""}),
        ("PUT", "/wrong-secret/metadata", {"key": OWN_SEGMENT}),
        ("PUT", f"/{SECRET}x/metadata", {"key": OWN_SEGMENT}),
        ("GET", "/health", {}),
    ],
)
async def test_requests_without_the_secret_are_refused(bridge, method, path, params):
    session, store, refusals = bridge
    await store.put(OWN_SEGMENT, b"the engine's")
    async with session.request(method, path, params=params, data=b"forged") as resp:
        assert resp.status == 403
        assert "secret" in await resp.text()
    assert await store.get(OWN_SEGMENT) == b"the engine's"
    assert refusals.counts == {"no_secret": 1}


@pytest.mark.parametrize(
    ("method", "key", "reason"),
    [
        ("PUT", PEER_SEGMENT, "foreign_key"),  # another engine's segment
        ("DELETE", PEER_SEGMENT, "foreign_key"),
        ("PUT", registry_key("prefill-b", 0), "foreign_key"),  # another engine's record
        ("PUT", "other-app/config", "foreign_key"),
        ("GET", "other-app/config", "foreign_key"),  # not a key the engine reads
        ("GET", serving_key("prefill-b"), "foreign_key"),
    ],
)
async def test_keys_not_of_this_engine_are_refused(bridge, method, key, reason):
    session, store, refusals = bridge
    await store.put(key, b"theirs")
    url = f"/{SECRET}/metadata"
    async with session.request(method, url, params={"key": key}, data=b"forged") as resp:
        assert resp.status == 403
        assert key in await resp.text()
    assert await store.get(key) == b"theirs"
    assert refusals.counts == {reason: 1}


async def test_a_listing_is_refused_even_with_the_secret(bridge):
    session, store, refusals = bridge
    await store.put(PEER_SEGMENT, b"theirs")
    async with session.get(f"/{SECRET}/metadata", params={"prefix": "mooncake/"}) as resp:
        assert resp.status == 403
    assert refusals.counts == {"listing": 1}


async def test_the_engines_own_path_works(bridge):
    session, store, refusals = bridge
    url = f"/{SECRET}/metadata"
    for key in sorted(SCOPE.own):
        async with session.put(url, params={"key": key}, data=b"mine") as resp:
            assert resp.status == 200
        async with session.get(url, params={"key": key}) as resp:
            assert (resp.status, await resp.read()) == (200, b"mine")
    await store.put(PEER_SEGMENT, b"peer")
    async with session.get(url, params={"key": PEER_SEGMENT}) as resp:
        assert (resp.status, await resp.read()) == (200, b"peer")
    async with session.get(url, params={"key": "mooncake/ram/absent:1"}) as resp:
        assert resp.status == 404
    async with session.delete(url, params={"key": OWN_SEGMENT}) as resp:
        assert resp.status == 200
    assert await store.get(OWN_SEGMENT) is None
    assert not refusals.counts


def test_refusals_are_counted_each_and_logged_at_a_bounded_rate(caplog):
    clock = FakeClock()
    refusals = Refusals(period_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="mooncake_vllm.transfer.store_bridge"):
        for _ in range(1000):
            refusals.refuse("no_secret", "PUT without the bridge's secret")
        refusals.refuse("foreign_key", "PUT of 'x', not this engine's key")
        assert len(caplog.records) == 1
        clock.now = 10.0
        refusals.refuse("no_secret", "GET without the bridge's secret")
    assert len(caplog.records) == 2
    # The second line sums what the first period did not report.
    assert "{'no_secret': 1000, 'foreign_key': 1}" in caplog.records[1].getMessage()
    assert refusals.counts == {"no_secret": 1001, "foreign_key": 1}


@contextlib.contextmanager
def _store_with_token():
    """The package's http metadata server (a ``MemoryStore`` behind a bearer token) on a real
    127.0.0.1 socket, served from its own thread: the bridge process pings it while this
    thread's caller waits for the bridge."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(metadata_app(MemoryStore(), token=TOKEN), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, name="test-http-store", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/metadata"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def _status(method: str, url: str, data: bytes | None = None, token: str | None = None) -> int:
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_local_user_cannot_forge_keys_through_the_bridge(monkeypatch):
    """The finding's reproduction: the store refuses a direct PUT (401); the same PUT to the
    bridge, without its secret, is refused too (it was 200), and nothing is republished."""
    monkeypatch.setenv("MOONCAKE_TEST_STORE_TOKEN", TOKEN)
    with _store_with_token() as store_url:
        forged = f"?key={PEER_SEGMENT}"
        assert _status("PUT", store_url + forged, b"forged") == 401
        bridge = MetadataBridge(
            MetadataTarget("http", (store_url,)),
            ttl_s=3,
            auth=MetadataAuth(token_env="MOONCAKE_TEST_STORE_TOKEN"),
            scope=SCOPE,
        )
        try:
            port_url, secret = bridge.url.rsplit("/", 2)[0], bridge.url.split("/")[3]
            assert len(secret) >= 32 and SECRET not in bridge.url
            assert bridge.url == f"{port_url}/{secret}/metadata"
            assert _status("PUT", f"{port_url}/metadata{forged}", b"forged") == 403
            assert _status("GET", f"{port_url}/metadata?key={OWN_SEGMENT}") == 403
            # With the secret, the engine itself still cannot write a peer's key.
            with pytest.raises(StoreUnavailable, match="HTTP 403"):
                bridge.publish(PEER_SEGMENT, b"forged")
            bridge.publish(OWN_SEGMENT, b"segment")  # the engine's own path
            assert bridge.lookup(OWN_SEGMENT) == b"segment"
            assert bridge.lookup(PEER_SEGMENT) is None  # a peer's key: readable, absent
            assert _status("GET", f"{store_url}?key={OWN_SEGMENT}", token=TOKEN) == 200
            assert _status("GET", f"{store_url}{forged}", token=TOKEN) == 404
        finally:
            bridge.close()
        assert _status("GET", f"{store_url}?key={OWN_SEGMENT}", token=TOKEN) == 404  # deleted


def test_the_engines_startup_error_does_not_show_the_bridges_secret():
    from mooncake_vllm.transfer.engine import _shown

    secret = "s3cr3t-path_Seg"
    shown = _shown(f"http://127.0.0.1:4000/{secret}/metadata")
    assert secret not in shown and shown == "http://127.0.0.1:4000/<secret>/metadata"
    assert _shown("P2PHANDSHAKE") == "P2PHANDSHAKE"
