"""Discovery: the serving record an engine publishes, and the proxy following the registry.

Pure parts first (the default ``advertise_url`` from a vLLM command line, the records → pools
mapping, pool membership, the flags). Then the proxy process (``proxy_server.py --discover``)
against real etcd, redis and http metadata servers, with records written into the store directly
and instant OpenAI-shaped backends behind them: a record that appears joins its pool, one deleted
or expired leaves, static flags stay. The same with real vLLM engines is in ``test_xpyd_e2e``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest

from harness import servers
from harness.xpyd import start_proxy
from mooncake_vllm.core import auth
from mooncake_vllm.core.registry import SERVING_PREFIX, ServingRecord, encode_serving, serving_key
from mooncake_vllm.core.serving_url import find_serving_url, url_from_vllm_argv
from mooncake_vllm.core.settings import ConfigError
from mooncake_vllm.metadata import StoreUnavailable, open_store, parse_metadata_server
from mooncake_vllm.p2p.config import load_settings
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.discovery import RegistryFollower, wanted_backends
from mooncake_vllm.proxy.failover import Backends, RequestContext
from mooncake_vllm.proxy.metrics import ProxyMetrics
from mooncake_vllm.proxy.routing import BackendPool, NoHealthyBackend
from mooncake_vllm.proxy.server import parse_args

API = "vllm.entrypoints.openai.api_server"


# ---- the default advertise_url ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["python", "-m", API, "--model", "m", "--host", "127.0.0.2", "--port", "8100"],
         "http://127.0.0.2:8100"),
        (["python", "-m", API, "--port=8200"], "http://10.0.0.7:8200"),  # all interfaces
        (["python", "-m", API, "--host", "0.0.0.0"], "http://10.0.0.7:8000"),  # vLLM's port
        (["/venv/bin/vllm", "serve", "m", "--host", "h1", "--port", "9"], "http://h1:9"),
        (["python", "-m", API, "--host", "h", "--port", "1", "--ssl-certfile", "c"],
         "https://h:1"),
        (["python", "-m", API, "--port", "notaport"], None),
        (["python", "-m", "vllm.v1.engine.core"], None),  # not the API server
        (["python", "serve.py", "--port", "8100"], None),
    ],
)  # fmt: skip
def test_serving_url_from_a_vllm_command_line(argv, expected):
    assert url_from_vllm_argv(argv, fallback_host="10.0.0.7") == expected


def test_serving_url_is_found_up_the_process_tree():
    # A process whose command line is a vLLM API server's, with a child: the child finds it.
    argv = [sys.executable, "-c", "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
            "time.sleep(30)", "-m", API, "--host", "127.0.0.9", "--port", "8123"]  # fmt: skip
    parent = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 10
        child = None
        while child is None and time.monotonic() < deadline:
            out = subprocess.run(
                ["pgrep", "-P", str(parent.pid)], capture_output=True, text=True
            ).stdout.split()
            child = int(out[0]) if out else None
            time.sleep(0.05)
        assert child is not None, "the child process did not start"
        assert find_serving_url("127.0.0.1", pid=child) == "http://127.0.0.9:8123"
        assert find_serving_url("127.0.0.1") is None  # pytest has no vLLM above it
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)], check=False)
        parent.kill()
        parent.wait()


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"metadata_server": "etcd://h:1", "advertise_url": "127.0.0.2:8100"},
         "advertise_url='127.0.0.2:8100'"),
        ({"metadata_server": "etcd://h:1", "advertise_url": "http://0.0.0.0:8100"},
         "names no host a proxy can reach"),
        ({"metadata_server": "etcd://h:1", "advertise_url": "http://h:8100/v1"}, "has a path"),
        ({"advertise_url": "http://127.0.0.2:8100"}, "set metadata_server to"),
    ],
)  # fmt: skip
def test_bad_advertise_url_is_a_startup_error_naming_the_key(extra, fragment):
    with pytest.raises(ConfigError) as e:
        load_settings(extra, env={})
    assert "advertise_url" in str(e.value) and fragment in str(e.value)


def test_good_advertise_url_is_normalized():
    s = load_settings({"metadata_server": "redis://h:1", "advertise_url": "http://h:8100/"}, {})
    assert s.advertise_url == "http://h:8100"


# ---- records → pools, membership, flags ---------------------------------------------------------


def _record(engine_id: str, role: str, url: str) -> bytes:
    return encode_serving(ServingRecord(engine_id=engine_id, role=role, url=url, compat_hash="c"))


def test_records_map_to_pools_by_role_and_bad_ones_are_reported():
    records = {
        serving_key("p"): _record("p", "kv_producer", "http://127.0.0.2:8100/"),
        serving_key("d"): _record("d", "kv_consumer", "http://127.0.0.3:8200"),
        serving_key("b"): _record("b", "kv_both", "http://127.0.0.4:8300"),
        serving_key("junk"): b"not json",
        serving_key("odd"): _record("odd", "kv_observer", "http://127.0.0.5:1"),
        serving_key("nourl"): _record("nourl", "kv_producer", "127.0.0.6:1"),
    }
    bad: dict[str, str] = {}
    assert wanted_backends(records, bad) == {
        "prefill": {"http://127.0.0.2:8100": "p", "http://127.0.0.4:8300": "b"},
        "decode": {"http://127.0.0.3:8200": "d", "http://127.0.0.4:8300": "b"},
    }
    assert bad == {serving_key(k): "invalid" for k in ("junk", "odd", "nourl")}


SECRET = auth.new_secret().encode()
OTHER_SECRET = auth.new_secret().encode()


@pytest.mark.parametrize(
    "keys, sealed_with, expected",
    [
        ((), None, None),  # no secret: records read as they are ...
        ((), (SECRET,), None),  # ... signed or not
        ((SECRET,), (SECRET,), None),
        ((OTHER_SECRET, SECRET), (SECRET,), None),  # rotation: any key verifies
        ((SECRET,), None, "unsigned"),
        ((SECRET,), (OTHER_SECRET,), "bad_signature"),
    ],
)
def test_records_must_verify_under_the_secret(keys, sealed_with, expected):
    data = _record("p", "kv_producer", "http://127.0.0.2:8100")
    if sealed_with is not None:
        data = auth.seal_record(sealed_with, data)
    bad: dict[str, str] = {}
    wanted = wanted_backends({serving_key("p"): data}, bad, keys)
    if expected is None:
        assert wanted["prefill"] == {"http://127.0.0.2:8100": "p"} and bad == {}
    else:
        assert wanted == {"prefill": {}, "decode": {}}
        assert bad == {serving_key("p"): expected}


def test_a_tampered_record_does_not_verify():
    sealed = auth.seal_record((SECRET,), _record("p", "kv_producer", "http://127.0.0.2:8100"))
    tampered = sealed.replace(b"127.0.0.2", b"127.0.0.9")
    bad: dict[str, str] = {}
    assert wanted_backends({"k": tampered}, bad, (SECRET,))["prefill"] == {}
    assert bad == {"k": "bad_signature"}


def test_a_joined_backend_waits_for_its_first_probe_and_a_removed_one_is_gone():
    now = [100.0]
    pool = BackendPool("decode", [], clock=lambda: now[0])
    with pytest.raises(NoHealthyBackend):
        pool.pick()
    assert pool.seconds_until_next_probe() == 1.0  # an empty pool still sleeps the prober
    joined = pool.add("http://a:1")
    assert joined is not None and pool.add("http://a:1") is None
    assert not joined.trusted and pool.add("http://c:1", trusted=True).trusted
    pool.remove("http://c:1")
    with pytest.raises(NoHealthyBackend):
        pool.pick()  # out of rotation until a probe passes ...
    assert pool.due_for_probe() == [joined]  # ... which is due at once
    for _ in range(6):  # still starting: probed every second, no backoff
        pool.probe_failed(joined, "connection refused")
        assert joined.next_probe_at_s == now[0] + 1.0
    pool.probe_ok(joined)
    assert not joined.joining
    other = pool.add("http://b:1")
    pool.probe_ok(other)
    assert [pool.pick().url for _ in range(3)] == ["http://a:1", "http://b:1", "http://a:1"]
    assert pool.remove("http://b:1") is other and pool.remove("http://b:1") is None
    assert [pool.pick().url for _ in range(2)] == ["http://a:1"] * 2


class _Registry:
    """The follower's view of a store: the serving records in it, or unreadable."""

    def __init__(self) -> None:
        self.records: dict[str, bytes] = {}
        self.up = True

    async def list(self, prefix: str) -> dict[str, bytes]:
        if not self.up:
            raise StoreUnavailable("connection refused")
        return {k: v for k, v in self.records.items() if k.startswith(prefix)}

    async def close(self) -> None:
        pass


def _following() -> tuple[_Registry, list[float], Backends, RegistryFollower]:
    """A follower of a fake registry on a clock the test moves (``now[0]``), 15 s of grace."""
    registry, now = _Registry(), [0.0]
    backends = Backends(ProxyConfig(discover="redis://h:1"), ProxyMetrics())
    follower = RegistryFollower(
        backends, "redis://h:1", 1.0, grace_s=15.0, clock=lambda: now[0], store=registry
    )
    return registry, now, backends, follower


async def test_a_store_that_lost_its_records_does_not_take_the_backends_away():
    registry, now, backends, follower = _following()
    p1 = {serving_key("p1"): _record("p1", "kv_producer", "http://p:1")}
    d1 = {serving_key("d1"): _record("d1", "kv_consumer", "http://d:1")}

    async def pools_after(records: dict[str, bytes] | None, wait_s: float = 1.0):
        """The pools after ``wait_s`` and one read of ``records`` (None: the store is down)."""
        now[0] += wait_s
        registry.up = records is not None
        registry.records = dict(records or {})
        await follower.refresh()
        return tuple({b.url for b in backends.pools[r].backends} for r in ("prefill", "decode"))

    both = ({"http://p:1"}, {"http://d:1"})
    assert await pools_after({**p1, **d1}) == both
    # The store restarts without its data: down, back empty, refilled one heartbeat at a time.
    assert await pools_after(None) == both
    assert await pools_after({}) == both
    assert await pools_after(p1, wait_s=5) == both
    assert await pools_after({**p1, **d1}, wait_s=5) == both
    # With the store answering all along, an engine that stops (its record deleted) leaves.
    assert await pools_after(p1, wait_s=10) == ({"http://p:1"}, set())
    # A registry emptied at once is a store that lost its data, not every engine stopping ...
    assert await pools_after({}) == ({"http://p:1"}, set())
    assert await pools_after({}, wait_s=14) == ({"http://p:1"}, set())
    # ... until the grace is over: then the missing record's backend leaves.
    assert await pools_after({}, wait_s=1) == (set(), set())


async def test_calls_on_a_backend_whose_record_lapsed_go_on_and_a_stopped_ones_are_resent():
    """A record gone for less than the grace had lapsed under a live engine (a late heartbeat):
    the call waiting on it gets its answer there. One gone for the grace is an engine that
    stopped: the call waiting on it is sent to the other decode."""
    registry, now, backends, follower = _following()
    d1 = {serving_key("d1"): _record("d1", "kv_consumer", "http://d:1")}
    d2 = {serving_key("d2"): _record("d2", "kv_consumer", "http://d:2")}

    async def read(records: dict[str, bytes], wait_s: float) -> None:
        now[0] += wait_s
        registry.records = dict(records)
        await follower.refresh()

    await read({**d1, **d2}, 1.0)
    pool = backends.pools["decode"]
    for b in pool.backends:
        b.healthy = True  # as their first probes would
    answer = {url: asyncio.Event() for url in ("http://d:1", "http://d:2")}
    sent: list[str] = []

    async def send(backend, deadline) -> str:
        sent.append(backend.url)
        await answer[backend.url].wait()
        return f"answer from {backend.url}"

    ctx = RequestContext("r-1", time.monotonic(), "/v1/completions", {}, {})
    call = asyncio.create_task(backends.call("decode", ctx, send, repeatable=False))
    while not sent:
        await asyncio.sleep(0)
    first = sent[0]
    lapsed = {"http://d:1": d2, "http://d:2": d1}[first]  # the other record only
    await read(lapsed, 1.0)  # first's record lapses ...
    await read(lapsed, 5.0)
    await read({**d1, **d2}, 5.0)  # ... and is back within the grace
    answer[first].set()
    attempt = await asyncio.wait_for(call, 5)
    assert attempt.answer == f"answer from {first}" and sent == [first]

    answer[first].clear()
    sent.clear()
    for b in pool.backends:
        b.healthy = True  # the returned one's probe
    call = asyncio.create_task(backends.call("decode", ctx, send, repeatable=False))
    while not sent:
        await asyncio.sleep(0)
    first = sent[0]
    other = ({"http://d:1", "http://d:2"} - {first}).pop()
    stopped = {"http://d:1": d2, "http://d:2": d1}[first]
    answer[other].set()
    await read(stopped, 1.0)
    await read(stopped, 10.0)
    assert not call.done()  # within the grace: still waiting where it was sent
    await read(stopped, 5.0)  # the grace is over: its engine stopped
    attempt = await asyncio.wait_for(call, 5)
    assert attempt.answer == f"answer from {other}" and sent == [first, other]


def test_discover_replaces_backend_flags_and_mixes_with_them():
    cfg = parse_args(["--discover", "etcd://127.0.0.1:2379"])
    assert (cfg.prefill, cfg.decode, cfg.discover) == ([], [], "etcd://127.0.0.1:2379")
    cfg = parse_args(["--discover", "redis://h:1", "--prefill", "http://h:2"])
    assert cfg.prefill == ["http://h:2"] and cfg.decode == []


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--discover", "P2PHANDSHAKE"], "--discover: P2PHANDSHAKE has no registry"),
        (["--discover", "ftp://h:1"], "--discover: metadata_server='ftp://h:1'"),
    ],
)
def test_bad_discovery_flags_exit_naming_the_fix(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


# ---- the proxy following a real store -----------------------------------------------------------


def _store_server(kind: str):
    return {
        "etcd": servers.start_etcd,
        "redis": servers.start_redis,
        "http": servers.start_http_metadata,
    }[kind]()


@pytest.fixture(scope="module")
def fake_backends():
    """Three instant OpenAI-shaped backends (``benchmarks.fake_backend``), started together."""
    procs, urls = [], []
    for host in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
        port = servers.free_port(host)
        argv = [sys.executable, "-m", "benchmarks.fake_backend", "--host", host]
        log = servers.default_log_dir() / f"fake-backend-{host}-{port}.log"
        procs.append(servers.ManagedProcess("fake-backend", [*argv, "--port", str(port)], log))
        urls.append(f"http://{host}:{port}")
    for proc in procs:
        proc.start()
    try:
        for proc, url in zip(procs, urls, strict=True):
            proc.wait_until(lambda u=url: servers.http_text(f"{u}/health") == "", 30, "healthy")
        yield urls
    finally:
        for proc in procs:
            proc.stop(grace_s=5)


@pytest.mark.servers
@pytest.mark.parametrize("kind", ["etcd", "redis", "http"])
async def test_proxy_follows_the_registry(kind, fake_backends, log_on_failure):
    store_srv = _store_server(kind)
    log_on_failure(store_srv)
    static_prefill, prefill_url, decode_url = fake_backends
    store_url = store_srv.url
    store = open_store(parse_metadata_server(store_url))
    proxy = None
    try:
        proxy = start_proxy(
            ["--discover", store_url, "--prefill", static_prefill, "--health-interval-s", "1"],
            log_dir=None,
        )
        log_on_failure(proxy)
        assert proxy.pool("prefill") == {static_prefill} and proxy.pool("decode") == set()

        # An engine's record appears: it joins, in rotation once its first probe passes.
        await store.put(serving_key("p1"), _record("p1", "kv_producer", prefill_url), ttl_s=30)
        await store.put(serving_key("d1"), _record("d1", "kv_consumer", decode_url), ttl_s=3)
        joined_s = proxy.wait_for(
            "both discovered backends in rotation",
            lambda: (
                proxy.pool("prefill", True) == {static_prefill, prefill_url}
                and proxy.pool("decode", True) == {decode_url}
            ),
            timeout_s=10,
        )
        print(f"{kind}: discovered backends in rotation {joined_s:.2f}s after their records")
        async with aiohttp.ClientSession() as http:
            for _ in range(2):  # round robin: the static and the discovered prefill
                async with http.post(
                    f"{proxy.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}
                ) as resp:
                    assert resp.status == 200, await resp.text()

        # The static prefill's engine publishes too: the registry never empties below (an
        # emptied one is taken as a store that lost its data: test above).
        await store.put(serving_key("p0"), _record("p0", "kv_producer", static_prefill))
        # A deleted record leaves at once; an expired one (no heartbeat) within its TTL.
        await store.delete(serving_key("p1"))
        proxy.wait_for("p1 gone", lambda: proxy.pool("prefill") == {static_prefill}, 5)
        left_s = proxy.wait_for("d1 expired", lambda: proxy.pool("decode") == set(), 10)
        print(f"{kind}: expired decode left {left_s:.2f}s after p1 did (its TTL is 3 s)")
        # Static backends stay, whatever the registry says.
        await store.delete(serving_key("p0"))
        await asyncio.sleep(1.5)
        assert proxy.pool("prefill") == {static_prefill}
    finally:
        await store.close()
        for srv in (proxy, store_srv):
            if srv is not None:
                srv.stop()


@pytest.mark.servers
async def test_listing_on_mooncakes_http_server_says_discovery_needs_ours():
    with servers.running(servers.start_http_metadata(mooncakes=True)) as srv:
        store = open_store(parse_metadata_server(srv.url))
        try:
            with pytest.raises(StoreUnavailable, match="cannot list keys"):
                await store.list(SERVING_PREFIX)
        finally:
            await store.close()
