"""Metadata stores and the bridge against real etcd, redis and http metadata servers (no vLLM).

The end-to-end proof with vLLM and the transfer engine is in ``test_metadata_e2e``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
import redis

from harness import servers
from mooncake_vllm.metadata import MetadataTarget, StoreUnavailable, open_store
from mooncake_vllm.transfer.store_bridge import KeyScope, MetadataBridge, MetadataUnavailable

pytestmark = pytest.mark.servers

KINDS = ["etcd", "redis", "http", "mooncake-http"]
# The bridge tests' engine: it owns "mine" and reads its peer's "theirs".
SCOPE = KeyScope(frozenset({"mine"}), readable_prefixes=("theirs",))


def _start(kind: str, port: int | None = None):
    if kind == "etcd":
        return servers.start_etcd(port=port)
    if kind == "redis":
        return servers.start_redis(port=port)
    return servers.start_http_metadata(port=port, mooncakes=kind == "mooncake-http")


def _target(kind: str, srv) -> MetadataTarget:
    where = f"{srv.host}:{srv.port}"
    if kind == "etcd":
        return MetadataTarget("etcd", (where,))
    if kind == "redis":
        return MetadataTarget("redis", (f"redis://{where}",))
    return MetadataTarget("http", (f"http://{where}/metadata",))


async def _eventually_gone(store, key: str, within_s: float) -> float:
    start = time.monotonic()
    while await store.get(key) is not None:
        assert time.monotonic() - start < within_s, f"{key} still there after {within_s}s"
        await asyncio.sleep(0.2)
    return time.monotonic() - start


@pytest.mark.parametrize("kind", KINDS)
async def test_store_round_trip(kind):
    with servers.running(_start(kind)) as srv:
        store = open_store(_target(kind, srv))
        try:
            await store.ping()
            key = "mooncake/ram/127.0.0.2:13003"
            assert await store.get(key) is None
            await store.put(key, b'{"v": 1}')
            await store.put(key, b'{"v": 2}')  # a restarted engine overwrites its own key
            assert await store.get(key) == b'{"v": 2}'
            await store.delete(key)
            assert await store.get(key) is None
            if kind != "mooncake-http":  # Mooncake's server has no TTLs
                await store.put("with-ttl", b"x", ttl_s=2)
                assert await store.get("with-ttl") == b"x"
                await _eventually_gone(store, "with-ttl", within_s=10)
        finally:
            await store.close()


async def test_mooncakes_http_server_refuses_a_restarted_engine_ours_does_not():
    """Why we ship our own http metadata server: an engine restarted under its name re-PUTs its
    rpc_meta key, which Mooncake's server refuses (the engine then fails to initialize)."""
    key = {"key": "mooncake/rpc_meta/127.0.0.2:13003"}
    statuses = {}
    for mooncakes in (True, False):
        with servers.running(servers.start_http_metadata(mooncakes=mooncakes)) as srv:
            url = f"http://{srv.host}:{srv.port}/metadata"
            async with aiohttp.ClientSession() as session:
                for _ in range(2):
                    async with session.put(url, params=key, data=b"{}") as resp:
                        statuses.setdefault(mooncakes, []).append(resp.status)
    assert statuses == {True: [200, 400], False: [200, 200]}


async def test_our_http_server_persists_and_reports_health(tmp_path):
    srv = servers.start_http_metadata(data_dir=tmp_path)
    url = f"http://{srv.host}:{srv.port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/health") as resp:
            assert resp.status == 200
        async with session.put(f"{url}/metadata", params={"key": "k"}, data=b"v") as resp:
            assert resp.status == 200
        async with session.put(f"{url}/metadata", params={"key": "k2", "ttl": "soon"}) as resp:
            assert resp.status == 400
            assert "ttl='soon'" in await resp.text()
        srv.stop()
        with servers.running(servers.start_http_metadata(port=srv.port, data_dir=tmp_path)):
            async with session.get(f"{url}/metadata", params={"key": "k"}) as resp:
                assert (resp.status, await resp.read()) == (200, b"v")


def test_bridge_rides_out_a_redis_outage_and_republishes_on_its_return():
    srv = servers.start_redis()
    port = srv.port
    bridge = MetadataBridge(_target("redis", srv), ttl_s=3, scope=SCOPE)
    try:
        r = redis.Redis(port=port)
        bridge.publish("mine", b"segment")
        r.set("theirs", b"peer")
        assert r.get("mine") == b"segment"
        assert 0 < r.ttl("mine") <= 3  # a crashed engine's keys go away by themselves
        assert bridge.lookup("theirs") == b"peer"

        srv.stop()  # the store goes away (and loses everything: no persistence)
        assert bridge.lookup("mine") == b"segment"
        assert bridge.lookup("theirs") == b"peer"  # peers already known keep working

        srv = servers.start_redis(port=port)
        r = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while r.get("mine") != b"segment":
            assert time.monotonic() < deadline, "own key not republished after the store returned"
            time.sleep(0.2)
        bridge.close()
        assert r.get("mine") is None  # a stopped engine removes its keys
    finally:
        bridge.close()
        srv.stop()


@pytest.mark.parametrize("kind", ["etcd", "redis", "http"])
def test_unreachable_store_fails_at_startup_with_the_fix(kind):
    port = servers.free_port()
    target = {
        "etcd": MetadataTarget("etcd", (f"127.0.0.1:{port}",)),
        "redis": MetadataTarget("redis", (f"redis://127.0.0.1:{port}",)),
        "http": MetadataTarget("http", (f"http://127.0.0.1:{port}/metadata",)),
    }[kind]
    start = time.monotonic()
    with pytest.raises(MetadataUnavailable) as exc:
        MetadataBridge(target, scope=SCOPE)
    assert time.monotonic() - start < 15
    message = str(exc.value)
    assert f"metadata_server ({kind} " in message
    assert str(port) in message
    assert "P2PHANDSHAKE" in message


def test_a_bridge_that_dies_is_reported_and_later_operations_fail_with_the_cause(caplog):
    srv = servers.start_redis()
    bridge = MetadataBridge(_target("redis", srv), ttl_s=3, scope=SCOPE)
    try:
        bridge.publish("mine", b"segment")
        os.kill(bridge._proc.pid, signal.SIGKILL)  # e.g. the OOM killer
        deadline = time.monotonic() + 10
        while bridge.death is None:
            assert time.monotonic() < deadline, "the bridge's death went unnoticed"
            time.sleep(0.05)
        assert "ended with signal 9" in caplog.text
        with pytest.raises(StoreUnavailable, match=r"metadata bridge process .* signal 9"):
            bridge.lookup("mine")
    finally:
        bridge.close()
        srv.stop()
