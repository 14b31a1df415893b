"""Hosts apart: prefill, decode, proxy, their metadata store (etcd), a reference vLLM and the
client each in their own network namespace (``harness.netns``), links cut while requests run at
concurrency 4.

On loopback a dead peer answers with a reset at once; across hosts a partition answers nothing
and a TCP read waits until a timer fires. Each test cuts a link while requests are in flight and
asserts what a user sees: every request ends per policy within its deadline (the decode's
``load_timeout_s`` bounds a pull, the proxy's ``--timeout-s`` a request), nothing stays held
(the prefill's ``held_leases``, the decode's running requests and KV blocks, the proxy's
in-flight gauge), and once the link is back every request is token-exact with 0 pull failures.

Costs nine vLLM starts (three per metadata store: etcd, then redis and our http store for the
metadata cut alone) and a few minutes of faults (~11 min in all): marked ``long`` (``make
test-long``, or ``make test-netns`` for this module alone), and skipped where namespaces cannot
be made (not root, no iproute2).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest

from harness import netns
from harness.pd import (
    PULL_COUNTERS,
    ServerSpec,
    client_session,
    complete,
    eventually,
    greedy_body,
    kv_args,
    mooncake_json,
    reference_spec,
    start_many,
    tokens_by_transfer,
)
from harness.servers import (
    ManagedProcess,
    _http_ok,
    default_log_dir,
    http_text,
    metric_totals,
    start_etcd,
    start_http_metadata,
    start_redis,
)

_why_not = netns.unavailable()
pytestmark = [
    pytest.mark.servers,
    pytest.mark.long,
    pytest.mark.skipif(_why_not is not None, reason=f"no network namespaces: {_why_not}"),
]

LOAD_TIMEOUT_S = 5.0  # the decode's bound on a pull
LEASE_TTL_S = 8.0  # the prefill's bound on a lease nobody acquires
# The prefill's bound on a lease acquired but never released: its load_timeout_s +
# stall_timeout_s (2) + 5 s. An acquire sent into a cut link arrives when the link returns, after
# the decode gave up on it; the decode's withdrawing release behind it ends the grant at once
# (SideChannelClient._withdraw), this is the bound if that is lost too.
PULL_HOLD_S = LOAD_TIMEOUT_S + 2 + 5
PROXY_TIMEOUT_S = 40.0  # the proxy's bound on a whole request
CUT_S = 10.0
# The bound on a decode's blocks held by reads queued to a host that vanished (see the last test).
GONE_HOST_RELEASE_S = 180.0
PORT = 8000
PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog " * 6 for i in range(12)]
MAX_TOKENS = 24


class Hosts:
    def __init__(self, net, model, ref, prefill, decode, proxy):
        self.net, self.model = net, model
        self.ref, self.prefill, self.decode, self.proxy = ref, prefill, decode, proxy

    @property
    def proxy_url(self) -> str:
        return f"http://{self.net.hosts['proxy'].address}:{PORT}"

    def proxy_status(self) -> str:
        """The proxy's ``/health`` status: ok, degraded (no prefill) or unavailable."""
        try:
            return json.loads(http_text(f"{self.proxy_url}/health"))["status"]
        except Exception as e:  # 503 while no decode is in rotation
            return f"unreachable ({e})"

    async def both_in_rotation(self) -> None:
        """Until the proxy has both backends in rotation again: a backend its probes ejected
        during a cut is probed again after a back-off (1 s doubling to 30 s)."""
        await eventually(lambda: self.proxy_status() == "ok", 45, "proxy status ok")

    def proxy_metric(self, name: str) -> float:
        return metric_totals(f"{self.proxy_url}/metrics", (name,)).get(name, 0.0)


def _start_store(net, store: str):
    """The engines' metadata store on the ``meta`` host: the server and its ``metadata_server``."""
    where, prefix = net.hosts["meta"].address, net.argv("meta", [])
    start, port = {"etcd": (start_etcd, 2379), "redis": (start_redis, 6379)}.get(
        store, (start_http_metadata, 8080)
    )
    with net.entered("client"):  # the health check's thread
        server = start(where, port, prefix=prefix)
    return server, server.url


@pytest.fixture(scope="module")
def hosts(request, tiny_model, tmp_path_factory):
    """The hosts, the engines' metadata store etcd unless a test asks for another (indirect
    parametrization: a module's worth of hosts per store)."""
    store = getattr(request, "param", "etcd")
    with netns.Network() as net:
        for name in ("client", "ref", "prefill", "decode", "proxy", "meta"):
            net.add_host(name)
        addr = {n: h.address for n, h in net.hosts.items()}
        meta, metadata_server = _start_store(net, store)
        cfg = mooncake_json(
            tmp_path_factory.mktemp("netns") / "mooncake.json",
            prefill_url=f"{addr['prefill']}:13003",
            decode_url=f"{addr['decode']}:13012",
            metadata_server=metadata_server,
        )
        env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
        producer = kv_args(
            "kv_producer", {"lease_ttl_s": LEASE_TTL_S, "load_timeout_s": LOAD_TIMEOUT_S}
        )
        consumer = kv_args(
            "kv_consumer", {"load_timeout_s": LOAD_TIMEOUT_S}, kv_load_failure_policy="recompute"
        )
        ref = reference_spec("ref-ns", addr["ref"])
        specs = [
            (ref.name, "ref", ref.args, ref.env),
            ("prefill-ns", "prefill", producer, env),
            ("decode-ns", "decode", consumer, env),
        ]
        specs = [
            ServerSpec(name, addr[h], args, env, port=PORT, prefix=net.argv(h, []))
            for name, h, args, env in specs
        ]
        # The test process talks to every part from the client's namespace (this thread, and
        # the threads start_many makes, are moved there).
        with net.entered("client"):
            started = start_many(tiny_model, specs)
            proxy = _start_proxy(net, addr)
            try:
                yield Hosts(net, tiny_model, *started, proxy)
            finally:
                proxy.stop()
                for srv in started:
                    srv.stop()
                meta.stop()


def _start_proxy(net, addr) -> ManagedProcess:
    argv = net.argv(
        "proxy",
        [
            sys.executable, "-m", "mooncake_vllm.proxy.server",
            "--prefill", f"http://{addr['prefill']}:{PORT}",
            "--decode", f"http://{addr['decode']}:{PORT}",
            "--host", addr["proxy"], "--port", str(PORT),
            "--timeout-s", str(PROXY_TIMEOUT_S), "--health-interval-s", "1",
        ],
    )  # fmt: skip
    log = default_log_dir() / f"proxy-netns-{os.getpid()}.log"
    proc = ManagedProcess("proxy-ns", argv, log).start()
    proc.wait_until(lambda: _http_ok(f"http://{addr['proxy']}:{PORT}/health"), 60, "healthy")
    return proc


@pytest.fixture(scope="module")
def expected(hosts) -> dict[str, list[int]]:
    """The reference's greedy tokens for every prompt."""

    async def run():
        async with client_session() as s:
            answers = await asyncio.gather(
                *(complete(s, hosts.ref, greedy_body(hosts.model, p, MAX_TOKENS)) for p in PROMPTS)
            )
        return {p: a.token_ids for p, a in zip(PROMPTS, answers, strict=True)}

    return asyncio.run(run())


async def _load(hosts, prompts, concurrency: int = 4, max_tokens: int = MAX_TOKENS):
    """Every prompt through the proxy (streamed), ``concurrency`` at a time: per prompt its
    tokens or the exception it ended with, and the seconds it took."""
    gate = asyncio.Semaphore(concurrency)
    out: dict[str, tuple[object, float]] = {}

    async def one(session, prompt):
        async with gate:
            t0 = time.monotonic()
            body = greedy_body(hosts.model, prompt, max_tokens, stream=True)
            try:
                result = (await complete(session, hosts.proxy_url, body)).token_ids
            except Exception as e:  # what the client saw is the result
                result = e
            out[prompt] = (result, time.monotonic() - t0)

    async with client_session(total_timeout_s=PROXY_TIMEOUT_S + 60) as s:
        await asyncio.gather(*(one(s, p) for p in prompts))
    return out


def _held(hosts) -> dict[str, float]:
    """What each side still holds: the prefill's leases, the decode's running requests and KV
    blocks in use, the proxy's requests outstanding on backends."""
    return {
        "prefill held_leases": hosts.prefill.metric("mooncake_vllm:held_leases"),
        "decode running": hosts.decode.metric("vllm:num_requests_running"),
        "decode kv_cache_usage": hosts.decode.metric("vllm:kv_cache_usage_perc"),
        "proxy in_flight": hosts.proxy_metric("mooncake_proxy_backend_in_flight"),
    }


async def _nothing_held(hosts, timeout_s: float) -> None:
    try:
        took_s = await eventually(lambda: not any(_held(hosts).values()), timeout_s, "held")
        print(f"nothing held {took_s:.1f}s after the load")
    except AssertionError as e:
        raise AssertionError(f"{e}: {_held(hosts)}") from None


async def _after_restore_all_exact(hosts, expected) -> None:
    """Nothing held, then a round at concurrency 4 token-exact, by transfer, 0 pull failures."""
    await hosts.both_in_rotation()
    await _nothing_held(hosts, max(LEASE_TTL_S, PULL_HOLD_S) + 15)
    before, by_transfer = PULL_COUNTERS.read(hosts.decode), tokens_by_transfer(hosts.decode)
    results = await _load(hosts, PROMPTS[:8])
    assert {p: r for p, (r, _) in results.items()} == {p: expected[p] for p in PROMPTS[:8]}
    await eventually(
        lambda: PULL_COUNTERS.since(hosts.decode, before)["pulls"] >= 8, 15, "8 pulls counted"
    )
    assert PULL_COUNTERS.since(hosts.decode, before)["pull_failures"] == 0
    assert tokens_by_transfer(hosts.decode) > by_transfer


async def _cut_during_load(hosts, cut, restore, prompts=PROMPTS):
    """The load; ``cut()`` once the decode has pulled at least once, ``restore()`` CUT_S later."""
    await hosts.both_in_rotation()
    before = PULL_COUNTERS.read(hosts.decode)
    load = asyncio.ensure_future(_load(hosts, prompts))
    await eventually(lambda: PULL_COUNTERS.since(hosts.decode, before)["pulls"] >= 1, 60, "pull")
    cut()
    try:
        await asyncio.sleep(CUT_S)
    finally:
        restore()
    return await load, PULL_COUNTERS.since(hosts.decode, before)


@pytest.mark.provokes_pull_failure
@pytest.mark.parametrize("one_way", [False, True], ids=["both-ways", "decode-to-prefill"])
async def test_prefill_decode_link_cut_during_pulls_then_restored(hosts, expected, one_way):
    """Pulls in flight across a dead link end at load_timeout_s and the decode recomputes
    (policy ``recompute``): every answer token-exact, none waiting on the dead read. One way:
    the decode's frames to the prefill are lost, the prefill's still arrive."""
    net = hosts.net
    results, moved = await _cut_during_load(
        hosts,
        lambda: net.cut_between("decode", "prefill", one_way=one_way),
        lambda: net.restore("prefill"),
    )
    for prompt, (tokens, took_s) in results.items():
        assert tokens == expected[prompt], f"{prompt!r}: {tokens!r}"
        assert took_s < PROXY_TIMEOUT_S, f"{prompt!r} took {took_s:.1f}s"
    assert moved["pull_failures"] >= 1, f"no pull crossed the cut: {moved}"
    await _after_restore_all_exact(hosts, expected)


async def test_decode_proxy_link_cut_mid_stream(hosts, expected):
    """A stream whose decode goes silent ends for the client by the proxy's deadline, not
    never; the decode, whose client vanished, frees the request's blocks once the link is back."""
    net = hosts.net
    await hosts.both_in_rotation()
    long = [p + " Stream." for p in PROMPTS[:4]]
    load = asyncio.ensure_future(_load(hosts, long, max_tokens=400))
    await eventually(lambda: hosts.decode.metric("vllm:num_requests_running") >= 1, 60, "decoding")
    net.cut_between("proxy", "decode")
    t_cut = time.monotonic()
    try:
        results = await asyncio.wait_for(load, PROXY_TIMEOUT_S + 30)
    finally:
        net.restore("decode")
    ended_s = time.monotonic() - t_cut
    for prompt, (tokens, took_s) in results.items():
        assert isinstance(tokens, Exception) or len(tokens) == 400, (prompt, tokens)
        assert took_s < PROXY_TIMEOUT_S + 10, f"{prompt!r} took {took_s:.1f}s"
    assert any(isinstance(t, Exception) for t, _ in results.values()), results
    assert ended_s < PROXY_TIMEOUT_S + 10
    await _after_restore_all_exact(hosts, expected)


@pytest.mark.provokes_pull_failure
async def test_metadata_store_cut_off_from_the_engines(hosts, expected):
    """etcd (the engines' metadata store) unreachable for 10 s under load: engines that know
    each other go on; a store call fails in 3 s rather than hanging; every answer token-exact,
    and after the link returns nothing held and 0 pull failures."""
    await _metadata_store_cut(hosts, expected)


async def _metadata_store_cut(hosts, expected) -> None:
    net = hosts.net
    results, moved = await _cut_during_load(
        hosts, lambda: net.cut("meta"), lambda: net.restore("meta")
    )
    for prompt, (tokens, took_s) in results.items():
        assert tokens == expected[prompt], f"{prompt!r}: {tokens!r}"
        assert took_s < PROXY_TIMEOUT_S, f"{prompt!r} took {took_s:.1f}s"
    print(f"pulls during the metadata cut: {moved}")
    await _after_restore_all_exact(hosts, expected)


@pytest.mark.provokes_pull_failure
async def test_prefill_host_gone_for_good(hosts, expected):
    """Last (it takes the prefill away): the prefill's host drops off the network during the
    load and never returns. Requests in flight end per policy within the proxy's deadline (a
    prefill leg in flight to the host waits for it: 504); the rest are computed by the decode
    (the proxy's degraded mode), token-exact; nothing stays running or outstanding."""
    net = hosts.net
    await hosts.both_in_rotation()
    # Slow links into the decode (a 1 MiB pull takes ~0.4 s), so reads are in flight at the cut.
    net.cap("decode", "20mbit")
    before = PULL_COUNTERS.read(hosts.decode)
    load = asyncio.ensure_future(_load(hosts, PROMPTS))
    await eventually(lambda: PULL_COUNTERS.since(hosts.decode, before)["pulls"] >= 1, 60, "pull")
    net.cut("prefill")
    hosts.prefill.stop()
    results = await asyncio.wait_for(load, PROXY_TIMEOUT_S + 30)
    for prompt, (tokens, took_s) in results.items():
        assert took_s < PROXY_TIMEOUT_S + 5, f"{prompt!r} took {took_s:.1f}s"
        if not isinstance(tokens, Exception):
            assert tokens == expected[prompt], prompt
    await eventually(
        lambda: (
            hosts.decode.metric("vllm:num_requests_running") == 0
            and hosts.proxy_metric("mooncake_proxy_backend_in_flight") == 0
        ),
        30,
        "no request running on the decode or outstanding at the proxy",
    )
    # A pull whose reads were queued in the transfer engine when the host vanished keeps its
    # destination blocks (no late write may land in a reused block) until the engine fails that
    # queue: when a reconnect round to the host has tried each of its 4 lanes, each connect
    # bounded by the kernel (here the neighbour entry fails: 51-85 s measured in all).
    took_s = await eventually(
        lambda: hosts.decode.metric("vllm:kv_cache_usage_perc") == 0,
        GONE_HOST_RELEASE_S,
        "decode KV freed",
    )
    print(f"decode KV freed {took_s:.1f}s after the load")


# After the test above took the etcd hosts' prefill away: fresh hosts per store (module-scoped
# hosts are parametrized indirectly; each store costs three vLLM starts).
@pytest.mark.provokes_pull_failure
@pytest.mark.parametrize("hosts", ["redis", "http"], indirect=True)
async def test_other_metadata_stores_cut_off_from_the_engines(hosts, expected):
    """As for etcd, with redis and with our http metadata store."""
    await _metadata_store_cut(hosts, expected)
