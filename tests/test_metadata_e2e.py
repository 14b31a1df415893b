"""Each metadata store end to end: a real store, prefill on 127.0.0.2 and decode on 127.0.0.3
configured from the example in configs/, outputs token-equal to a plain vLLM, prompts moved by
transfer; the engine registry; restarts of a peer, and of the store while requests flow through
the proxy.

One pair of vLLM servers per store serves every check of that store (a vLLM start costs most of a
minute of a core here). Requests one at a time, or a restart of one engine, leave the second core
idle: the next store's pair starts beside each test's checks, and the vLLM that must stop at
startup beside the etcd test's restart of its producer. A restarted consumer is the xPyD module's
(tests/test_xpyd_e2e.py: the rolling restart stops a decode and starts it again; it rejoins).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from harness import servers
from harness.pd import (
    DECODE_HOST,
    PREFILL_HOST,
    PULL_COUNTERS,
    ServerSpec,
    complete,
    eventually,
    greedy_body,
    kv_args,
    pulls_since,
    start_many,
    tokens_by_transfer,
    two_legs,
)
from harness.xpyd import ProxyServer, start_proxy
from mooncake_vllm.core.registry import decode_record, registry_key
from mooncake_vllm.metadata import open_store, parse_metadata_server

pytestmark = pytest.mark.servers

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MAX_TOKENS = 8
# The shared P2P pair uses the examples' ports on these hosts: each store's pair takes its own
# (the http pair starts while the redis pair runs).
PORTS = {"etcd": (13203, 13212), "redis": (13223, 13232), "http": (13243, 13252)}
METADATA_TTL_S = 6.0  # heartbeat every 2 s: a returning store is refilled quickly
# The store stays down longer than the engines' metadata refresh (5 s with a store) and the
# bridges' heartbeat (2 s): both meet the dead store while requests flow.
OUTAGE_S = 7.0
LOAD_CONCURRENCY = 4
# Every request through the proxy answers within this, or the test says which one hung.
REQUEST_DEADLINE_S = 60.0
STORES = {
    "etcd": servers.start_etcd,
    "redis": servers.start_redis,
    "http": servers.start_http_metadata,
}


class Pair:
    def __init__(self, kind: str, model: str, tmp_path: Path):
        """The store and the pair's config; ``start`` starts the pair."""
        self.kind, self.model = kind, model
        self.prefill_port, self.decode_port = PORTS[kind]
        self.store_server = STORES[kind]()
        # The user's example file, pointed at the store this test started.
        cfg = json.loads((CONFIGS / f"mooncake-tcp-{kind}.json").read_text())
        where = f"{self.store_server.host}:{self.store_server.port}"
        # etcd in the seed's bare form, read with metadata_backend
        cfg["metadata_server"] = where if kind == "etcd" else self.store_server.url
        cfg["prefill_url"] = f"{PREFILL_HOST}:{self.prefill_port}"
        cfg["decode_url"] = f"{DECODE_HOST}:{self.decode_port}"
        cfg["metadata_ttl_s"] = METADATA_TTL_S
        # Beside the shared cluster's prefill on the same address, which serves the bootstrap
        # service on its default port.
        cfg["bootstrap_port"] = 0
        self.config_path = tmp_path / f"mooncake-{kind}.json"
        self.config_path.write_text(json.dumps(cfg))
        self.target = parse_metadata_server(cfg["metadata_server"], cfg.get("metadata_backend"))
        env = {"MOONCAKE_CONFIG_PATH": str(self.config_path)}
        self.prefill_id, self.decode_id = f"prefill-{kind}", f"decode-{kind}"
        consumer_args = kv_args(
            "kv_consumer", engine_id=self.decode_id, kv_load_failure_policy="recompute"
        )
        self.specs = {
            "prefill": ServerSpec(
                f"prefill-{kind}",
                PREFILL_HOST,
                kv_args("kv_producer", engine_id=self.prefill_id),
                env,
            ),
            "decode": ServerSpec(f"decode-{kind}", DECODE_HOST, consumer_args, env),
        }

    def start(self) -> Pair:
        try:
            self.prefill, self.decode = start_many(self.model, list(self.specs.values()))
        except Exception:
            self.store_server.stop()
            raise
        return self

    def watch(self, log_on_failure) -> None:
        for srv in (self.store_server, self.prefill, self.decode):
            log_on_failure(srv)

    def restart(self, which: str) -> float:
        """SIGKILL one side (no clean shutdown: its keys stay behind) and start it again under
        the same name; returns seconds until it is healthy."""
        old = getattr(self, which)
        os.killpg(old.process.proc.pid, signal.SIGKILL)
        old.stop()
        start = time.monotonic()
        (new,) = start_many(self.model, [self.specs[which]])
        setattr(self, which, new)
        return time.monotonic() - start

    def kill_store(self) -> None:
        """SIGKILL the store: no clean shutdown, connections drop."""
        os.killpg(self.store_server.process.proc.pid, signal.SIGKILL)
        self.store_server.stop()  # reaps it

    def restart_store(self, keep_data: bool) -> None:
        """Start the killed store again on the same address: with its data (etcd's data dir, as
        a restarted member has it) or empty (redis without persistence, an http server with a
        fresh file)."""
        old = self.store_server
        more = {"data_dir": old.data_dir} if keep_data else {}
        self.store_server = STORES[self.kind](port=old.port, **more)

    @property
    def store_url(self) -> str:
        """The store as ``proxy_server.py --discover`` takes it."""
        return self.store_server.url

    def engine_keys(self) -> list[str]:
        """What each engine's bridge keeps in the store: its registry record and its transfer
        engine's segment."""
        return [
            registry_key(self.prefill_id, 0),
            f"mooncake/ram/{PREFILL_HOST}:{self.prefill_port}",
            registry_key(self.decode_id, 0),
            f"mooncake/ram/{DECODE_HOST}:{self.decode_port}",
        ]

    async def store_get(self, key: str) -> bytes | None:
        store = open_store(self.target)
        try:
            return await store.get(key)
        finally:
            await store.close()

    def stop(self) -> None:
        with ThreadPoolExecutor(2) as pool:  # each vLLM takes seconds to shut down
            list(pool.map(lambda srv: srv.stop(), (self.decode, self.prefill)))
        self.store_server.stop()


class Pairs:
    """Each store's pair, started when its test takes it or, ahead of that, in the background
    (``begin``) beside a restart of one engine, which leaves the second core idle."""

    def __init__(self, model: str, tmp_path_factory, wanted: set[str]):
        self.model, self._tmp, self.wanted = model, tmp_path_factory, wanted
        self._pool = ThreadPoolExecutor(len(STORES))
        self._pairs: dict[str, Future] = {}

    def begin(self, kind: str) -> Future | None:
        """Start ``kind``'s pair in the background, if its test is to run and it has not begun."""
        if kind not in self._pairs and kind in self.wanted:
            tmp = self._tmp.mktemp(kind)
            self._pairs[kind] = self._pool.submit(lambda: Pair(kind, self.model, tmp).start())
        return self._pairs.get(kind)

    def take(self, kind: str, log_on_failure) -> Pair:
        self.wanted.add(kind)
        pair = self.begin(kind).result()
        pair.watch(log_on_failure)
        return pair

    def close(self) -> None:
        for started in self._pairs.values():
            with contextlib.suppress(Exception):  # a failed start: its test reported it
                started.result().stop()
        self._pool.shutdown()


@pytest.fixture(scope="module")
def pairs(request, tiny_model, tmp_path_factory):
    here = Path(__file__).resolve()
    tests = [i.name for i in request.session.items if Path(str(i.path)).resolve() == here]
    wanted = {kind for kind in STORES if any(t.startswith(f"test_{kind}_") for t in tests)}
    p = Pairs(tiny_model, tmp_path_factory, wanted)
    yield p
    p.close()


def _prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


_body = partial(greedy_body, max_tokens=MAX_TOKENS)


async def _handover(pd, pair: Pair, http, seed: int, strip_address: bool = False) -> bool:
    """One request through the pair; asserts plain-equal output, returns whether it was pulled."""
    prompt = _prompt(seed)
    ref = await complete(http, pd.plain, _body(pd.model, prompt))
    pulls0 = pair.decode.metric("mooncake_vllm:pulls_total")
    fails0 = pair.decode.metric("mooncake_vllm:pull_failures_total")
    if strip_address:  # the decode must find the producer by engine id alone
        head = await complete(
            http, pair.prefill,
            {**_body(pd.model, prompt), "max_tokens": 1,
             "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"strip-{seed}"}},
        )  # fmt: skip
        params = {**head.kv_transfer_params, "side_channel_host": "", "side_channel_ports": []}
        tail = await complete(
            http, pair.decode, {**_body(pd.model, prompt), "kv_transfer_params": params}
        )
    else:
        _, tail = await two_legs(http, pair.prefill, pair.decode, _body(pd.model, prompt))
    assert tail.token_ids == ref.token_ids
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if pair.decode.metric("mooncake_vllm:pulls_total") > pulls0:
            return True
        if pair.decode.metric("mooncake_vllm:pull_failures_total") > fails0:
            return False
        await asyncio.sleep(0.1)
    raise AssertionError("the pull neither finished nor failed within 10 s")


async def _check_basics(pd, pair: Pair, http) -> None:
    # Token-exact, prompt tokens by transfer (decode's own counters).
    ext0 = pair.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    for seed in (1, 2):
        assert await _handover(pd, pair, http, seed)
    ext = pair.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert ext - ext0 >= 2 * (300 - 1)

    # Each side advertises its own address, not the machine's first interface.
    for host, port in ((PREFILL_HOST, pair.prefill_port), (DECODE_HOST, pair.decode_port)):
        rpc_meta = json.loads(await pair.store_get(f"mooncake/rpc_meta/{host}:{port}"))
        assert rpc_meta["ip_or_host_name"] == host

    # The engine registry names the producer's side channel and segment under its engine id.
    record = decode_record(await pair.store_get(registry_key(pair.prefill_id, 0)))
    assert (record.role, record.side_channel) == (
        "kv_producer",
        f"{PREFILL_HOST}:{pair.prefill_port + 1}",
    )
    assert record.te_segment == f"{PREFILL_HOST}:{pair.prefill_port}"
    assert decode_record(await pair.store_get(registry_key(pair.decode_id, 0))).side_channel == ""
    # ... so a handoff that names only the producer's engine id is enough.
    assert await _handover(pd, pair, http, seed=3, strip_address=True)


async def _keys_gone(pair: Pair, keys: list[str], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    for key in keys:
        while await pair.store_get(key) is not None:
            assert time.monotonic() < deadline, f"{key} still in the store after the engine stopped"
            await asyncio.sleep(0.25)


async def _pulled_at_once(pd, pair: Pair, http, seed: int) -> float:
    """The first request after a restart is pulled, token-exact, with no pull failing first
    (the survivor's engine re-reads the restarted peer's metadata while its warm-up waits)."""
    fails0 = pair.decode.metric("mooncake_vllm:pull_failures_total")
    start = time.monotonic()
    assert await _handover(pd, pair, http, seed), "the first request after the restart failed"
    assert pair.decode.metric("mooncake_vllm:pull_failures_total") == fails0
    return time.monotonic() - start


@dataclass
class _Sent:
    """One request of the load: what was asked, in which phase of the store, what came back."""

    seed: int
    stream: bool
    proxy: str
    phase: str
    token_ids: list[int] | None = None
    error: str | None = None


class _Load:
    """``LOAD_CONCURRENCY`` clients sending distinct prompts through the proxies (each client
    keeps to one proxy), streamed and not by turns, until ``stop``. Each request is tagged with
    the store's phase when it was sent; an error or a missed deadline is recorded, not raised."""

    def __init__(self, http, model: str, proxies: list[ProxyServer], first_seed: int):
        self.http, self.model, self.proxies = http, model, proxies
        self.phase = "up"
        self.sent: list[_Sent] = []
        self._next_seed = first_seed
        self._stopping = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._client(proxies[i % len(proxies)]))
            for i in range(LOAD_CONCURRENCY)
        ]

    async def _client(self, proxy: ProxyServer) -> None:
        while not self._stopping.is_set():
            seed, self._next_seed = self._next_seed, self._next_seed + 1
            sent = _Sent(seed, stream=seed % 2 == 1, proxy=proxy.url, phase=self.phase)
            self.sent.append(sent)
            body = {**_body(self.model, _prompt(seed)), "stream": sent.stream}
            try:
                answer = await asyncio.wait_for(
                    complete(self.http, proxy.url, body), REQUEST_DEADLINE_S
                )
                sent.token_ids = answer.token_ids
            except TimeoutError:
                sent.error = f"no answer within {REQUEST_DEADLINE_S:g}s"
            except Exception as e:
                sent.error = f"{type(e).__name__}: {e}"

    def answered(self, phase: str) -> int:
        return sum(
            s.phase == phase and (s.token_ids is not None or s.error is not None) for s in self.sent
        )

    async def until_answered(self, phase: str, n: int) -> None:
        await eventually(lambda: self.answered(phase) >= n, 60, f"{n} answers while {phase}")

    async def stop(self) -> list[_Sent]:
        """Let each client finish the request it is in, then return every request sent."""
        self._stopping.set()
        await asyncio.gather(*self._tasks)
        return self.sent

    async def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _start_proxies(pair: Pair) -> list[ProxyServer]:
    """The proxy as the README starts it (the pair's URLs), and one that finds both engines in
    the store (``--discover``)."""
    static, discovering = await asyncio.gather(
        asyncio.to_thread(
            start_proxy, ["--prefill", pair.prefill.url, "--decode", pair.decode.url]
        ),
        asyncio.to_thread(start_proxy, ["--discover", pair.store_url]),
    )
    for proxy in (static, discovering):
        await eventually(
            lambda p=proxy: p.health()["status"] == "ok", 20, "both engines in rotation"
        )
    return [static, discovering]


async def _store_restart_under_load(
    pd, pair: Pair, http, log_on_failure, keep_data: bool, first_seed: int
) -> None:
    """Requests flow through the proxies while the store is killed, stays down ``OUTAGE_S``
    and comes back on the same address. Engines that know each other need no store: a handoff
    names the producer's side channel, and each bridge answers its engine from its cache. So
    every request answers, token-exact, every prompt moved by transfer, no pull failing."""
    proxies = await _start_proxies(pair)
    for proxy in proxies:
        log_on_failure(proxy)
    decode = pair.decode
    before = PULL_COUNTERS.read(decode)
    load = _Load(http, pd.model, proxies, first_seed)
    try:
        await load.until_answered("up", LOAD_CONCURRENCY)
        await asyncio.to_thread(pair.kill_store)
        load.phase = "down"
        down_at = time.monotonic()
        await load.until_answered("down", LOAD_CONCURRENCY)
        await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
        await asyncio.to_thread(pair.restart_store, keep_data)
        log_on_failure(pair.store_server)
        load.phase = "back"
        # Each engine's bridge republishes its keys on its next heartbeat (an empty store).
        deadline = time.monotonic() + 3 * METADATA_TTL_S
        for key in pair.engine_keys():
            while await pair.store_get(key) is None:
                assert time.monotonic() < deadline, f"{key} not in the store after it returned"
                await asyncio.sleep(0.25)
        load.phase = "after"
        await load.until_answered("after", 2 * LOAD_CONCURRENCY)
        sent = await load.stop()
    finally:
        await load.cancel()  # a no-op unless a step above failed
        for proxy in proxies:
            proxy.stop()

    failed = [s for s in sent if s.error is not None]
    assert not failed, f"{len(failed)} of {len(sent)} requests failed: {failed[:4]}"
    refs = await asyncio.gather(
        *(complete(http, pd.plain, _body(pd.model, _prompt(s.seed))) for s in sent)
    )
    wrong = [s for s, ref in zip(sent, refs, strict=True) if s.token_ids != ref.token_ids]
    assert not wrong, f"{len(wrong)} of {len(sent)} answers differ from plain: {wrong[:4]}"
    moved = await pulls_since(decode, before, len(sent), timeout_s=15)
    assert (moved["pulls"], moved["pull_failures"]) == (len(sent), 0)
    phases = {p: sum(s.phase == p for s in sent) for p in ("up", "down", "back", "after")}
    print(f"{pair.kind} restart under load: {len(sent)} requests {phases}, all pulled")

    # Requests after the restart are still served by transfer (the decode's own counters).
    ext0 = tokens_by_transfer(decode)
    for seed in (first_seed - 1, first_seed - 2):
        assert await _handover(pd, pair, http, seed)
    assert tokens_by_transfer(decode) - ext0 >= 2 * (300 - 1)
    assert PULL_COUNTERS.since(decode, before)["pull_failures"] == 0


@pytest.mark.long
async def test_etcd_seed_form_restart_under_load_and_a_restarted_producer(
    pd, http, pairs, log_on_failure, unreachable_store_start
):
    pair = pairs.take("etcd", log_on_failure)
    pairs.begin("redis")
    try:
        await _check_basics(pd, pair, http)
        await _store_restart_under_load(
            pd, pair, http, log_on_failure, keep_data=True, first_seed=1000
        )
        # A handoff of the producer's previous life, to be used after its restart.
        old_prompt = _prompt(9)
        ask = {**_body(pd.model, old_prompt), "max_tokens": 1}
        ask["kv_transfer_params"] = {"do_remote_decode": True}
        head = await complete(http, pair.prefill, ask)
        # Crash the producer (its keys stay in etcd) and restart it on the same address; the
        # vLLM of test_unreachable_store_stops_vllm_at_startup starts (and stops) beside it.
        unreachable = unreachable_store_start.begin()
        start_s = pair.restart("prefill")
        futures.wait([unreachable], timeout=300)  # its core is free for what follows
        usable_s = await _pulled_at_once(pd, pair, http, seed=10)
        print(f"producer restart: healthy in {start_s:.1f}s, first pull took {usable_s:.1f}s")
        # The old handoff is refused by the new incarnation at once; the decode's policy
        # (recompute) answers, token-exact.
        fails0 = pair.decode.metric("mooncake_vllm:pull_failures_total")
        ref = await complete(http, pd.plain, _body(pd.model, old_prompt))
        t0 = time.monotonic()
        params = head.kv_transfer_params
        again = {**_body(pd.model, old_prompt), "kv_transfer_params": params}
        tail = await complete(http, pair.decode, again)
        assert tail.token_ids == ref.token_ids
        assert time.monotonic() - t0 < 5
        assert pair.decode.metric("mooncake_vllm:pull_failures_total") == fails0 + 1
        log = pair.decode.process.log_path.read_text(errors="replace")
        assert "the producer restarted" in log
    finally:
        keys = [
            registry_key(pair.prefill_id, 0),
            f"mooncake/ram/{PREFILL_HOST}:{pair.prefill_port}",
        ]
        pair.prefill.stop()
        await _keys_gone(pair, keys)
        pair.stop()


async def test_redis_restart_under_load(pd, http, pairs, log_on_failure):
    pair = pairs.take("redis", log_on_failure)
    pairs.begin("http")
    try:
        await _check_basics(pd, pair, http)
        # The store goes away under load and comes back empty: every request answers.
        await _store_restart_under_load(
            pd, pair, http, log_on_failure, keep_data=False, first_seed=2000
        )
    finally:
        pair.stop()


async def test_http_metadata_server_and_its_restart(pd, http, pairs, log_on_failure):
    pair = pairs.take("http", log_on_failure)
    try:
        await _check_basics(pd, pair, http)
        await _store_restart_under_load(
            pd, pair, http, log_on_failure, keep_data=False, first_seed=3000
        )
    finally:
        keys = [
            registry_key(pair.decode_id, 0),
            f"mooncake/ram/{DECODE_HOST}:{pair.decode_port}",
        ]
        pair.decode.stop()
        await _keys_gone(pair, keys)
        pair.stop()


class _UnreachableStart:
    """The start of a vLLM whose store nobody serves, in the background: it runs on one core for
    most of a minute before it stops. ``begin`` starts it once (the etcd test does, beside its
    producer's restart; the test of it does, if it runs alone)."""

    def __init__(self, model: str, config: Path, port: int, pool: ThreadPoolExecutor):
        self.model, self.config, self.port, self._pool = model, config, port, pool
        self.started: Future | None = None

    def begin(self) -> Future:
        if self.started is None:
            self.started = self._pool.submit(
                servers.start_vllm,
                self.model,
                name="unreachable-store",
                args=kv_args("kv_consumer"),
                env={"MOONCAKE_CONFIG_PATH": str(self.config)},
                timeout_s=300,
            )
        return self.started


@pytest.fixture(scope="module")
def unreachable_store_start(tiny_model, tmp_path_factory):
    port = servers.free_port()
    config = tmp_path_factory.mktemp("unreachable") / "mooncake.json"
    config.write_text(json.dumps({"metadata_server": f"redis://127.0.0.1:{port}"}))
    with ThreadPoolExecutor(1) as pool:
        start = _UnreachableStart(tiny_model, config, port, pool)
        yield start
        if start.started is not None:
            with contextlib.suppress(Exception):  # it started after all: its test failed on that
                start.started.result().stop()


def test_unreachable_store_stops_vllm_at_startup(unreachable_store_start: _UnreachableStart):
    port, started = unreachable_store_start.port, unreachable_store_start.begin()
    with pytest.raises(servers.ServerStartError) as exc:
        started.result(timeout=300).stop()
    message = str(exc.value)
    assert "exited" in message  # it stopped by itself, not at the harness's deadline
    assert f"metadata_server (redis redis://127.0.0.1:{port}) cannot be used" in message
    assert "P2PHANDSHAKE" in message
