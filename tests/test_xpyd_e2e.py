"""2P2D end to end: two prefills and two decodes (real vLLMs on their own 127.0.0.x), one proxy.

The proxy is started the way the README's xPyD section says: one prefill given as a flag, the
other engines found in etcd (``--discover``), where each engine publishes its OpenAI URL, signed
with the shared secret (``auth_secret_file``) the proxy verifies (``--auth-secret-file``). Then:

1. 40 requests at concurrency 4 are token-exact against a plain vLLM, every engine is used (its
   own counters), and every prompt is pulled from the prefill that computed it: each prefill's
   leases released by a decode's pull equal the prompts it computed, the decodes pulled once per
   request, no pull failed.
2. Forged serving records (one unsigned, one signed with another key) written straight into etcd,
   pointing at a backend that records every request: the proxy counts and ignores them, and the
   fake sees no request (not even a health probe) while real requests run token-exact.
3. A rolling restart under steady load (c=4): one prefill, then one decode, stopped with SIGTERM
   (vLLM's ``--shutdown-timeout`` drain), restarted on the same address, back in rotation. Every
   request through the proxy is answered token-exact; a prompt the prefill held when told to stop
   is pulled from it while it drains, and none of its leases expires; a stream running on the
   decode when told to stop finishes whole.
4. One prefill and one decode (both discovered) are SIGKILLed mid-run: the only requests that fail
   are those whose decode leg was streaming from the killed decode; every other is token-exact;
   the killed engines leave the pools when their registry records expire; later requests succeed
   on the survivors (one of them the static prefill), whose KV usage returns to zero. (A static
   backend's ejection and return by health probes is in ``test_proxy_faults``; here its probes
   back off up to 30 s while it is down.)

Every test starts from all four engines in rotation (an engine a test left stopped is started
again first, and must rejoin by discovery and serve) and judges counters by their deltas, so
each can run alone (``-k``) or in any order. The last test leaves its killed engines down: a
restart after a crash is the rolling restart's (graceful) and the metadata module's (a SIGKILLed
producer restarted under the same name) — one restart of two vLLMs fewer in the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from benchmarks import fake_backend
from harness import servers
from harness.pd import client_session, complete, eventually, kv_args, sse_events
from harness.xpyd import ProxyServer, start_proxy
from mooncake_vllm.core import auth
from mooncake_vllm.core.registry import (
    SERVING_PREFIX,
    ServingRecord,
    decode_serving,
    encode_serving,
    serving_key,
)
from mooncake_vllm.metadata import open_store, parse_metadata_server
from mooncake_vllm.proxy import prefix

pytestmark = pytest.mark.servers

METADATA_TTL_S = 4.0  # a killed engine's record is gone this long after its last heartbeat
LEASE_TTL_S = 6.0  # a prefill frees a prompt nobody pulled (its decode was killed) this fast
LOAD_TIMEOUT_S = 8.0
PROXY_TIMEOUT_S = 60.0
# vLLM's --shutdown-timeout: on SIGTERM an engine finishes its requests, and tears down, within
# this. The drains here end at once; the teardown after them took 8-25 s, and once (2026-11-26, a
# slow hour of this host) 30 s, its worker outliving vLLM's 5 s grace and its engine core 21 s
# more after the worker was killed.
SHUTDOWN_TIMEOUT_S = 45
DISCOVER_INTERVAL_S = 1.0  # the proxy's default --discover-interval-s
MAX_TOKENS = 8
BLOCK_SIZE = 128  # vLLM's default on CPU
CONCURRENCY = 4
# Ports apart from the other e2e modules' engines (they may share a session with this one).
TE_PORT = 13403
# Engines restarted under the rolling restart's load start at this nice value (their session's:
# Linux's autogroup shares the CPU between sessions), back to 0 once healthy. On 2 cores the load
# (c=4, unchanged) otherwise stretched their start from ~60 s to ~190 s.
RESTART_NICE = -10


@dataclass(frozen=True)
class Engine:
    name: str
    role: str
    host: str
    port: int  # the OpenAI server's
    events_port: int = 0  # where vLLM publishes its KV events (--policy kv)

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.events_port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def args(self) -> list[str]:
        own_url = "prefill_url" if self.role == "kv_producer" else "decode_url"
        extra = {own_url: f"{self.host}:{TE_PORT}", "lease_ttl_s": LEASE_TTL_S,
                 "load_timeout_s": LOAD_TIMEOUT_S}  # fmt: skip
        top = {"engine_id": f"xpyd-{self.name}"}
        if self.role == "kv_consumer":
            top["kv_load_failure_policy"] = "recompute"
        # vLLM binds a tcp://* publisher on every interface; the port tells the engines apart.
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{self.events_port}"}  # fmt: skip
        return [*kv_args(self.role, extra, **top), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                "--kv-events-config", json.dumps(events)]  # fmt: skip


ENGINES = [
    Engine("p1", "kv_producer", "127.0.0.21", 0),
    Engine("p2", "kv_producer", "127.0.0.22", 0),
    Engine("d1", "kv_consumer", "127.0.0.23", 0),
    Engine("d2", "kv_consumer", "127.0.0.24", 0),
]


@dataclass
class Drain:
    """What one graceful stop (SIGTERM to the API server) looked like from outside."""

    exited_s: float  # from SIGTERM to the whole process group gone
    exit_code: int | None
    last_metrics: dict[str, float] = field(default_factory=dict)  # its last /metrics read
    shutdown_log: list[str] = field(default_factory=list)  # vLLM's "[shutdown]" lines


class Cluster:
    def __init__(self, model: str, config_env: dict[str, str], etcd_url: str) -> None:
        self.model, self.env, self.etcd_url = model, config_env, etcd_url
        self.engines = {
            e.name: Engine(
                e.name, e.role, e.host, servers.free_port(e.host), servers.free_port("0.0.0.0")
            )
            for e in ENGINES
        }
        self.servers: dict[str, servers.VllmServer] = {}
        self.plain: servers.VllmServer | None = None
        self.proxy: ProxyServer | None = None

    def start(self, names: list[str], nice: int = 0) -> float:
        """Start engines together (at ``nice`` until healthy); seconds until all are healthy."""
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(names)) as pool:
            futures = {n: pool.submit(self._start_one, n, nice) for n in names}
            errors = []
            for n, f in futures.items():
                try:
                    srv = f.result()
                except Exception as e:
                    errors.append(e)
                    continue
                self.servers[n] = srv
        if errors:
            raise errors[0]
        return time.monotonic() - t0

    def _start_one(self, name: str, nice: int = 0) -> servers.VllmServer:
        e = self.engines[name]
        srv = servers.start_vllm(
            self.model, name=f"xpyd-{name}", host=e.host, port=e.port, args=e.args(),
            env=self.env, timeout_s=900, nice=nice,
        )  # fmt: skip
        if nice:
            srv.process.renice(nice, 0)
        return srv

    def kill(self, name: str) -> None:
        """SIGKILL the engine's whole process group: no clean shutdown, its record stays."""
        srv = self.servers.pop(name)
        os.killpg(srv.process.proc.pid, signal.SIGKILL)
        srv.stop()

    def terminate(self, name: str) -> Drain:
        """SIGTERM to the engine's API server, as ``kill PID`` or a container stop sends it, and
        wait until its whole process group has exited, reading its ``/metrics`` meanwhile."""
        srv = self.servers.pop(name)
        proc = srv.process
        log_offset = proc.log_path.stat().st_size  # the log file holds its earlier lives too
        t0 = time.monotonic()
        os.kill(proc.proc.pid, signal.SIGTERM)
        last: dict[str, float] = {}
        deadline_s = t0 + SHUTDOWN_TIMEOUT_S + 60
        # poll() reaps the API server (our child) once it exits; the rest of its group are its
        # children, reaped by init.
        while (proc.proc.poll() is None or proc.group_pids()) and time.monotonic() < deadline_s:
            with contextlib.suppress(Exception):
                last = srv.metrics()
            time.sleep(0.25)
        exited_s = time.monotonic() - t0
        srv.stop()  # whatever is left (nothing, unless the deadline passed)
        lines = proc.log_path.read_bytes()[log_offset:].decode(errors="replace").splitlines()
        log = [line for line in lines if "[shutdown]" in line]
        return Drain(exited_s, proc.proc.returncode, last, log)

    def stop(self) -> None:
        """Everything at once: an engine told to stop drains (``--shutdown-timeout``) and its
        worker takes 15-20 s to exit here."""
        running = [srv for srv in [self.proxy, *self.servers.values()] if srv is not None]
        with ThreadPoolExecutor(len(running) or 1) as pool:
            list(pool.map(lambda srv: srv.stop(), running))


@pytest.fixture(scope="module")
def xpyd(tiny_model, cluster, tmp_path_factory):
    """Four engines, a proxy discovering them; the references come from the shared cluster's
    plain server (same model), so no fifth vLLM starts here."""
    etcd = servers.start_etcd()
    etcd_url = etcd.url
    where = tmp_path_factory.mktemp("xpyd")
    secret = where / "secret"
    secret.write_text(auth.new_secret() + "\n")
    secret.chmod(0o600)
    config = where / "mooncake.json"
    config.write_text(json.dumps({"metadata_server": etcd_url, "metadata_ttl_s": METADATA_TTL_S,
                                  "auth_secret_file": str(secret)}))  # fmt: skip
    shared = cluster
    cluster = Cluster(tiny_model, {"MOONCAKE_CONFIG_PATH": str(config)}, etcd_url)
    failed = True
    try:
        start_s = cluster.start(list(cluster.engines))
        cluster.plain = shared.plain
        print(f"\n4 engines healthy in {start_s:.0f}s")
        p1 = cluster.engines["p1"]
        cluster.proxy = start_proxy(
            ["--prefill", p1.url, "--discover", etcd_url, "--auth-secret-file", str(secret),
             "--discover-interval-s", str(DISCOVER_INTERVAL_S), "--health-interval-s", "1",
             "--timeout-s", str(PROXY_TIMEOUT_S), "--log-level", "info"]
        )  # fmt: skip
        cluster.proxy.wait_for("all four engines in rotation", lambda: _pools_are(cluster), 30)
        yield cluster
        failed = False
    finally:
        if failed:
            for srv in [cluster.proxy, *cluster.servers.values(), etcd]:
                if srv is not None:
                    proc = srv.process
                    print(f"\n===== log of {proc.name} ({proc.log_path}) =====\n{proc.log_tail()}")
        cluster.stop()
        etcd.stop()


def _pools_are(c: Cluster, prefill=("p1", "p2"), decode=("d1", "d2")) -> bool:
    assert c.proxy is not None
    return c.proxy.pool("prefill", True) == {c.engines[n].url for n in prefill} and c.proxy.pool(
        "decode", True
    ) == {c.engines[n].url for n in decode}


async def _all_in_rotation(c: Cluster) -> None:
    """Every test starts here, whatever ran before it: an engine an earlier test left stopped
    starts again, rejoins by its new registry record, and serves (token-exact)."""
    stopped = [name for name in c.engines if name not in c.servers]
    if stopped:
        start_s = await asyncio.to_thread(c.start, stopped)
        print(f"\n{stopped} started again, healthy in {start_s:.0f}s")
    await asyncio.to_thread(c.proxy.wait_for, "all four engines in rotation",
                            lambda: _pools_are(c), 30)  # fmt: skip
    if stopped:
        before = _counters(c)
        again = _prompts(seed=4, n=8)
        again_refs = await _references(c, again)
        results = await _run(c.proxy.url, [_body(c.model, p, i) for i, p in enumerate(again)])
        assert [getattr(r, "token_ids", r) for r, _ in results] == again_refs
        after = _counters(c)
        assert all(_delta(after, before, n, "requests") > 0 for n in stopped), (stopped, after)


def _prompts(seed: int, n: int, lo: int = 24, hi: int = 160) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _body(model: str, prompt: list[int], i: int, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": i % 2 == 1}  # fmt: skip


async def _run(
    url, bodies, concurrency: int = CONCURRENCY, headers: dict[str, str] | None = None
) -> list[tuple[object, float]]:
    """Every body through ``url`` at ``concurrency``: (Answer or the error, seconds) each."""
    sem = asyncio.Semaphore(concurrency)
    async with client_session(total_timeout_s=PROXY_TIMEOUT_S + 30) as http:
        http.headers.update(headers or {})

        async def one(body):
            async with sem:
                t0 = time.monotonic()
                try:
                    result = await complete(http, url, body)
                except Exception as e:  # the test judges it
                    result = e
                return result, time.monotonic() - t0

        return await asyncio.gather(*(one(b) for b in bodies))


def _counters(c: Cluster) -> dict[str, dict[str, float]]:
    names = {
        "requests": "vllm:request_success_total",
        "released": "mooncake_vllm:released_total",
        "expired": "mooncake_vllm:expired_total",
        "pulls": "mooncake_vllm:pulls_total",
        "pull_failures": "mooncake_vllm:pull_failures_total",
    }
    out = {n: {k: srv.metric(m) for k, m in names.items()} for n, srv in c.servers.items()}
    for n, srv in c.servers.items():
        out[n]["external"] = srv.metric(
            "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
    return out


def _delta(after, before, name, key):
    return after[name][key] - before[name][key]


def _nothing_held(srv: servers.VllmServer) -> bool:
    return srv.metric("mooncake_vllm:held_leases") == 0 and srv.metric(
        "vllm:kv_cache_usage_perc"
    ) == pytest.approx(0.0, abs=1e-9)


async def _references(c: Cluster, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    bodies = [_body(c.model, p, 0, max_tokens) for p in prompts]
    results = await _run(c.plain.url, bodies)
    return [r.token_ids for r, _ in results]


async def test_2p2d_token_exact_every_engine_used_every_pull_from_its_prefill(xpyd):
    c = xpyd
    await _all_in_rotation(c)
    prompts = _prompts(seed=1, n=40)
    refs = await _references(c, prompts)
    before = _counters(c)
    t0 = time.monotonic()
    results = await _run(c.proxy.url, [_body(c.model, p, i) for i, p in enumerate(prompts)])
    took_s = time.monotonic() - t0
    errors = [r for r, _ in results if isinstance(r, Exception)]
    assert not errors, errors
    assert [r.token_ids for r, _ in results] == refs
    await eventually(
        lambda: sum(_delta(_counters(c), before, d, "pulls") for d in ("d1", "d2")) >= 40,
        20, "a pull per request",
    )  # fmt: skip
    after = _counters(c)
    d = {n: {k: _delta(after, before, n, k) for k in after[n]} for n in after}
    print(f"\n40 requests at c=4 in {took_s:.1f}s; counter deltas {d}")
    # Every prefill and every decode served (their own counters).
    for p in ("p1", "p2"):
        assert d[p]["requests"] > 0, f"{p} computed no prompt"
    for dec in ("d1", "d2"):
        assert d[dec]["requests"] > 0 and d[dec]["pulls"] > 0, f"{dec} pulled nothing"
    assert sum(d[p]["requests"] for p in ("p1", "p2")) == 40
    assert sum(d[x]["requests"] for x in ("d1", "d2")) == 40
    # Each prompt pulled once, from the prefill that computed it: a prefill's leases are released
    # only by the pull that read them (their handoff named that prefill), one per prompt it
    # computed; no pull failed, and every prompt token but the last came by transfer.
    assert sum(d[x]["pulls"] for x in ("d1", "d2")) == 40
    assert all(d[x]["pull_failures"] == 0 for x in c.servers)
    for p in ("p1", "p2"):
        await eventually(
            lambda p=p: c.servers[p].metric("mooncake_vllm:released_total")
            - before[p]["released"] == d[p]["requests"],
            10, f"{p}: a released lease per prompt it computed",
        )  # fmt: skip
    external = sum(d[x]["external"] for x in ("d1", "d2"))
    total = sum(len(p) for p in prompts)
    assert total - len(prompts) <= external <= total
    for srv in c.servers.values():
        await eventually(lambda s=srv: _nothing_held(s), 20, f"{srv.process.name} holds KV")


# ---- forged registry records --------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _recording_backend(host: str) -> AsyncIterator[tuple[str, list[tuple[str, str, dict]]]]:
    """``benchmarks.fake_backend`` in this process, noting every request it gets:
    ``(url, [(method, path, headers), ...])``."""
    seen: list[tuple[str, str, dict]] = []

    @web.middleware
    async def note(request: web.Request, handler):
        seen.append((request.method, request.path, dict(request.headers)))
        return await handler(request)

    app = fake_backend.make_app()
    app.middlewares.append(note)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = servers.free_port(host)
    await web.TCPSite(runner, host, port).start()
    try:
        yield f"http://{host}:{port}", seen
    finally:
        await runner.cleanup()


def _ignored(c: Cluster) -> dict[str, float]:
    name = "mooncake_proxy_registry_records_ignored_total"
    return {r: c.proxy.metric(name, reason=r) for r in ("unsigned", "bad_signature", "invalid")}


async def _kv_proxy(c: Cluster):
    """Our proxy with ``--policy kv`` over the four engines, hearing each one's KV events."""
    e = c.engines
    events = [f"--kv-events={x.url}={x.events_endpoint}" for x in e.values()]
    return await asyncio.to_thread(
        start_proxy,
        [*(f"--prefill={e[n].url}" for n in ("p1", "p2")),
         *(f"--decode={e[n].url}" for n in ("d1", "d2")),
         "--policy", "kv", *events, "--health-interval-s", "1",
         "--timeout-s", str(PROXY_TIMEOUT_S)],
    )  # fmt: skip


def _not_the_rings(e, body: dict) -> tuple[str, str]:
    """The prefill and the decode the prefix ring would not send ``body`` to: where only the
    engines' events can send it."""
    key = prefix.prefix_key(body)
    out = []
    for names in (("p1", "p2"), ("d1", "d2")):
        urls = [e[n].url for n in names]
        ring = prefix.choose(prefix.Ring.of(urls), key, {}, urls)
        out.append(next(n for n in names if e[n].url != ring))
    return out[0], out[1]


async def _until_heard(proxy, e, holder_p: str, holder_d: str) -> None:
    def heard() -> bool:
        report = proxy.health()
        return all(
            next(b for b in report[role] if b["url"] == e[n].url)["cached_blocks"] > 0
            for role, n in (("prefill", holder_p), ("decode", holder_d))
        )

    await asyncio.to_thread(proxy.wait_for, "the holders' blocks in the index", heard, 10)


async def test_kv_policy_sends_a_follow_up_turn_where_its_blocks_are(xpyd):
    """``--policy kv`` on real KV events: a chat's first turn is computed on the prefill and the
    decode that ``--policy prefix`` would not pick (sent to them directly); the proxy hears
    their blocks and sends the second turn to both; the decode pulls only the new blocks;
    the answer equals plain vLLM's."""
    c = xpyd
    await _all_in_rotation(c)
    e = c.engines
    proxy = await _kv_proxy(c)
    try:
        rng = random.Random(39)
        turn1 = [rng.randrange(3, 2048) for _ in range(3 * BLOCK_SIZE)]
        turn2 = [*turn1, *(rng.randrange(3, 2048) for _ in range(60))]
        body2 = _body(c.model, turn2, 0)
        # Where the prefix ring sends this chat, and so where events alone can send it.
        holder_p, holder_d = _not_the_rings(e, body2)
        async with client_session(total_timeout_s=PROXY_TIMEOUT_S) as http:
            for name in (holder_p, holder_d):  # plain requests: each computes turn 1 itself
                await complete(http, c.servers[name].url, _body(c.model, turn1, 0, 1))

        await _until_heard(proxy, e, holder_p, holder_d)
        ref = (await _references(c, [turn2]))[0]
        before = _counters(c)
        ((answer, _),) = await _run(proxy.url, [body2])
        after = _counters(c)
    finally:
        await asyncio.to_thread(proxy.stop)
    assert not isinstance(answer, Exception), answer
    assert answer.token_ids == ref
    served = {n: _delta(after, before, n, "requests") for n in e}
    assert served == {n: 1 if n in (holder_p, holder_d) else 0 for n in e}, served
    pulled = _delta(after, before, holder_d, "external")
    assert _delta(after, before, holder_d, "pull_failures") == 0
    # The decode held turn 1's blocks: it pulled the rest of turn 2 (60 tokens), not all 444.
    assert 0 < pulled <= len(turn2) - len(turn1), (pulled, len(turn2))


async def test_kv_policy_routes_a_chats_next_turn_by_its_tokenized_history(xpyd):
    """A multi-turn chat as chat messages (text, as clients send it): the proxy tokenizes it
    with the model's chat template (``proxy.tokens``, the tokenizer found from the engines'
    ``/v1/models``), so the engines' KV events match it: the first turn, computed on the
    prefill and decode the prefix ring would not pick, draws the second turn to both, whose
    decode pulls only what the first turn did not leave there; the answer equals plain's."""
    c = xpyd
    await _all_in_rotation(c)
    e = c.engines
    proxy = await _kv_proxy(c)
    rng = random.Random(41)
    words = " ".join(f"w{rng.randrange(10_000)}" for _ in range(600))
    turn1 = [{"role": "user", "content": words}]
    turn2 = [*turn1, {"role": "assistant", "content": "noted"},
             {"role": "user", "content": "and then?"}]  # fmt: skip

    def chat(messages, max_tokens=MAX_TOKENS):
        return {"model": c.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True}  # fmt: skip

    try:
        await asyncio.to_thread(
            proxy.wait_for, "the tokenizer", lambda: proxy.health().get("tokenizer"), 60
        )
        holder_p, holder_d = _not_the_rings(e, chat(turn2))
        async with client_session(total_timeout_s=PROXY_TIMEOUT_S) as http:
            for name in (holder_p, holder_d):  # plain requests: each computes turn 1 itself
                url = f"{c.servers[name].url}/v1/chat/completions"
                async with http.post(url, json=chat(turn1, 1)) as resp:
                    assert resp.status == 200, await resp.text()

            await _until_heard(proxy, e, holder_p, holder_d)
            async with http.post(f"{c.plain.url}/v1/chat/completions", json=chat(turn2)) as resp:
                ref = (await resp.json())["choices"][0]
            before = _counters(c)
            async with http.post(f"{proxy.url}/v1/chat/completions", json=chat(turn2)) as resp:
                data = await resp.json()
                assert resp.status == 200, data
            after = _counters(c)
    finally:
        await asyncio.to_thread(proxy.stop)
    got = data["choices"][0]
    assert (got["message"]["content"], got.get("token_ids")) == (
        ref["message"]["content"],
        ref.get("token_ids"),
    )
    served = {n: _delta(after, before, n, "requests") for n in e}
    assert served == {n: 1 if n in (holder_p, holder_d) else 0 for n in e}, served
    assert _delta(after, before, holder_d, "pull_failures") == 0
    pulled = _delta(after, before, holder_d, "external")
    # The decode held turn 1's full blocks: it pulled the rest of turn 2, not the whole prompt.
    assert 0 < pulled < data["usage"]["prompt_tokens"] - BLOCK_SIZE, (pulled, data["usage"])


async def test_forged_registry_records_get_no_request(xpyd):
    c = xpyd
    await _all_in_rotation(c)
    store = open_store(parse_metadata_server(c.etcd_url))
    # The forgeries copy a real engine's record (a signed one: the engines hold the secret) and
    # change only the URL, as someone who can write to the store but lacks the secret would.
    real = await store.list(SERVING_PREFIX)
    signed = real[serving_key("xpyd-p2")]
    assert signed.startswith(auth.RECORD_MAGIC), "the engines' records are not signed"
    template = decode_serving(auth.open_record((), signed))
    prompts = _prompts(seed=5, n=16)
    refs = await _references(c, prompts)
    before = _ignored(c)
    async with _recording_backend("127.0.0.25") as (fake_url, seen):
        unsigned = ServingRecord(engine_id="xpyd-forged-1", role="kv_producer", url=fake_url,
                                 compat_hash=template.compat_hash)  # fmt: skip
        wrong_key = ServingRecord(engine_id="xpyd-forged-2", role="kv_consumer", url=fake_url,
                                  compat_hash=template.compat_hash)  # fmt: skip
        forged = {
            serving_key(unsigned.engine_id): encode_serving(unsigned),
            serving_key(wrong_key.engine_id): auth.seal_record(
                (auth.new_secret().encode(),), encode_serving(wrong_key)
            ),
        }
        try:
            for key, value in forged.items():
                await store.put(key, value)
            await eventually(
                lambda: _ignored(c)["unsigned"] > before["unsigned"]
                and _ignored(c)["bad_signature"] > before["bad_signature"],
                5 * DISCOVER_INTERVAL_S, "the proxy read the forged records",
            )  # fmt: skip
            t0 = time.monotonic()
            # A client key the backends would see: a forged backend must not collect it.
            results = await _run(
                c.proxy.url, [_body(c.model, p, i) for i, p in enumerate(prompts)],
                headers={"Authorization": "Bearer client-key-a-forger-wants"},
            )  # fmt: skip
            # At least five discovery reads (and health-probe rounds) with the forgeries present.
            await asyncio.sleep(max(0.0, 5 * DISCOVER_INTERVAL_S - (time.monotonic() - t0)))
            pools = {role: c.proxy.pool(role) for role in ("prefill", "decode")}
        finally:
            for key in forged:
                await store.delete(key)
            await store.close()
        print(f"\nforged records present {time.monotonic() - t0:.1f}s; the fake saw {seen}")
        assert [getattr(r, "token_ids", r) for r, _ in results] == refs
        assert seen == [], "a forged backend got requests"
        assert fake_url not in pools["prefill"] | pools["decode"]
        # Counted once each, however many reads saw them.
        delta = {r: n - before[r] for r, n in _ignored(c).items()}
        assert delta == {"unsigned": 1, "bad_signature": 1, "invalid": 0}
    remaining = await _list_serving(c.etcd_url)
    assert not any("forged" in k for k in remaining), remaining


async def _list_serving(etcd_url: str) -> dict[str, bytes]:
    store = open_store(parse_metadata_server(etcd_url))
    try:
        return await store.list(SERVING_PREFIX)
    finally:
        await store.close()


# ---- a rolling restart and a crash --------------------------------------------------------------

# Longer answers than elsewhere, so a decode has streams running when it is told to stop.
ROLLING_MAX_TOKENS = 32
STRADDLING_MAX_TOKENS = 256  # a stream on a decode at its SIGTERM (64 ended before it once)


@dataclass(frozen=True)
class Outcome:
    prompt_index: int
    result: object  # Answer, or the exception the client saw
    sent_s: float  # since the load started
    took_s: float


class SteadyLoad:
    """``concurrency`` clients sending requests through the proxy back to back (prompts in turn,
    streamed every other one) until the block ends; every outcome is kept, none is retried.

    ``async with SteadyLoad(...) as load:`` owns the client tasks: leaving the block stops them
    after their current request and awaits them."""

    def __init__(self, url: str, model: str, prompts: list[list[int]], max_tokens: int) -> None:
        self.url, self.model, self.prompts, self.max_tokens = url, model, prompts, max_tokens
        self.outcomes: list[Outcome] = []
        self._sent = 0
        self._stop = asyncio.Event()
        self._clients: list[asyncio.Task] = []

    async def __aenter__(self) -> SteadyLoad:
        self._http = client_session(total_timeout_s=PROXY_TIMEOUT_S + 30)
        self._started_s = time.monotonic()
        self._clients = [asyncio.create_task(self._client()) for _ in range(CONCURRENCY)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            await asyncio.gather(*self._clients)
        finally:
            await self._http.close()

    async def _client(self) -> None:
        while not self._stop.is_set():
            n, self._sent = self._sent, self._sent + 1
            i = n % len(self.prompts)
            body = _body(self.model, self.prompts[i], n, self.max_tokens)
            t0 = time.monotonic()
            try:
                result = await complete(self._http, self.url, body)
            except Exception as e:  # the test judges it
                result = e
            self.outcomes.append(Outcome(i, result, t0 - self._started_s, time.monotonic() - t0))

    async def answered(self, count: int, timeout_s: float = 60) -> None:
        """Wait until ``count`` more requests have ended."""
        target = len(self.outcomes) + count
        await eventually(lambda: len(self.outcomes) >= target, timeout_s, f"{count} answers")


def _draining_refusals(c: Cluster) -> float:
    """Legs the proxy sent elsewhere because a backend refused them while shutting down."""
    return c.proxy.metric("mooncake_proxy_backend_errors_total", kind="draining")


async def _stop_gracefully(c: Cluster, load: SteadyLoad, name: str) -> tuple[dict, Drain]:
    """SIGTERM ``name`` under the load and wait for its exit; what happened, for the test."""
    engine = c.engines[name]
    role = "prefill" if engine.role == "kv_producer" else "decode"
    pull_failures = "mooncake_vllm:pull_failures_total"
    decodes = [c.servers[d] for d in ("d1", "d2") if d != name]
    # One read of each before the signal, so it comes soon after the caller asked for it.
    own = c.servers[name].metrics()
    failures = sum(d.metrics().get(pull_failures, 0.0) for d in decodes)
    in_flight = c.proxy.metric("mooncake_proxy_backend_in_flight", role=role, backend=engine.url)
    refusals = _draining_refusals(c)
    answered = len(load.outcomes)
    out_s, drain = await asyncio.gather(
        asyncio.to_thread(
            c.proxy.wait_for, f"{name} out of rotation",
            lambda: engine.url not in c.proxy.pool(role, True), 30,
        ),
        asyncio.to_thread(c.terminate, name),
    )  # fmt: skip
    facts = {
        "proxy_in_flight_at_sigterm": in_flight,
        "out_of_rotation_s": out_s,
        "exited_s": drain.exited_s,
        "exit_code": drain.exit_code,
        # vLLM kills an engine still draining at --shutdown-timeout, and says so.
        "killed_at_deadline": any("force killing" in line for line in drain.shutdown_log),
        "answered_meanwhile": len(load.outcomes) - answered,
        "refusals_retried": _draining_refusals(c) - refusals,
        "pull_failures": sum(d.metric(pull_failures) for d in decodes) - failures,
    }
    if role == "prefill":  # its leases as its last /metrics read before it exited saw them
        last = drain.last_metrics
        facts["held_leases_at_exit"] = last.get("mooncake_vllm:held_leases", -1)
        for counter in ("released", "expired"):
            key = f"mooncake_vllm:{counter}_total"
            facts[counter] = last.get(key, 0) - own.get(key, 0)
    return facts, drain


async def _start_again(c: Cluster, name: str, facts: dict[str, float]) -> None:
    """Start ``name`` on its address again and wait until the proxy has it back in rotation."""
    engine = c.engines[name]
    role = "prefill" if engine.role == "kv_producer" else "decode"
    facts["restart_s"] = await asyncio.to_thread(c.start, [name], RESTART_NICE)
    facts["rejoin_s"] = await asyncio.to_thread(
        c.proxy.wait_for, f"{name} back in rotation",
        lambda: engine.url in c.proxy.pool(role, True), 30,
    )  # fmt: skip
    print(f"\n{name} stopped gracefully and restarted: {facts}")


async def _prefill_leg(http, url: str, body: dict) -> dict:
    """What the proxy's prefill leg does: one token, and the handoff the prefill now holds."""
    params = {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex}
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
    handoff = (await complete(http, url, leg)).kv_transfer_params
    assert handoff is not None, f"{url} answered no handoff"
    return handoff


@pytest.mark.long
async def test_rolling_restart_under_load_fails_no_request(xpyd):
    c = xpyd
    await _all_in_rotation(c)
    prompts = _prompts(seed=6, n=64)
    refs = await _references(c, prompts, max_tokens=ROLLING_MAX_TOKENS)
    # Two requests of our own straddle the SIGTERMs: a prompt p2 holds when told to stop, whose
    # decode comes to pull it once p2 drains; a stream running on d2 when it is told to stop.
    late, running = _prompts(seed=7, n=2, lo=100, hi=400)
    (late_ref,) = await _references(c, [late], max_tokens=ROLLING_MAX_TOKENS)
    (running_ref,) = await _references(c, [running], max_tokens=STRADDLING_MAX_TOKENS)
    late_body = _body(c.model, late, 0, ROLLING_MAX_TOKENS)
    running_body = {**_body(c.model, running, 1, STRADDLING_MAX_TOKENS), "return_token_ids": True}
    t0 = time.monotonic()
    async with (
        SteadyLoad(c.proxy.url, c.model, prompts, ROLLING_MAX_TOKENS) as load,
        client_session(total_timeout_s=PROXY_TIMEOUT_S) as http,
    ):
        await load.answered(8)
        p2_log = c.servers["p2"].process.log_path
        drains = p2_log.read_text(errors="replace").count("EngineCore: start mode=drain")
        handoff = await _prefill_leg(http, c.engines["p2"].url, late_body)
        stopping = asyncio.create_task(_stop_gracefully(c, load, "p2"))
        await eventually(
            lambda: p2_log.read_text(errors="replace").count("EngineCore: start mode=drain")
            > drains,
            10, "p2 draining",
        )  # fmt: skip
        late_answer = await complete(
            http, c.engines["d1"].url, {**late_body, "kv_transfer_params": handoff}
        )
        p2, _ = await stopping
        # p2 stays down through d2's stop (p1 and d1 serve), and both start again together: one
        # start of two engines costs little more than one of one here, two in turn twice as much.
        await load.answered(8)

        handoff = await _prefill_leg(http, c.engines["p1"].url, running_body)
        decode_body = {**running_body, "kv_transfer_params": handoff}
        running_ids: list[int] = []
        async with http.post(f"{c.engines['d2'].url}/v1/completions", json=decode_body) as resp:
            assert resp.status == 200, await resp.text()
            stopping = None
            async for event in sse_events(resp):
                for choice in event["choices"]:
                    running_ids += choice.get("token_ids") or []
                if stopping is None:  # its first token is out: d2 is told to stop now
                    stopping = asyncio.create_task(_stop_gracefully(c, load, "d2"))
        d2, d2_drain = await stopping
        await asyncio.gather(_start_again(c, "p2", p2), _start_again(c, "d2", d2))
        await asyncio.to_thread(
            c.proxy.wait_for, "all four engines in rotation", lambda: _pools_are(c), 30
        )
        await load.answered(8)
    took_s = time.monotonic() - t0
    failed = [(o.sent_s, str(o.result)) for o in load.outcomes if isinstance(o.result, Exception)]
    differ = [o for o in load.outcomes if not isinstance(o.result, Exception)
              and o.result.token_ids != refs[o.prompt_index]]  # fmt: skip
    slowest = max(load.outcomes, key=lambda o: o.took_s)
    drained = [line for line in d2_drain.shutdown_log if "draining in-flight requests" in line]
    print(f"rolling restart: {len(load.outcomes)} requests at c={CONCURRENCY} in {took_s:.0f}s, "
          f"{len(failed)} failed, {len(differ)} not token-exact, slowest {slowest.took_s:.1f}s "
          f"(sent at {slowest.sent_s:.0f}s); d2 at SIGTERM: {drained}")  # fmt: skip
    # Every request through the proxy answered, token-exact: what a stopping engine refused went
    # to the other one, and a stopping engine finished what it had.
    assert failed == []
    assert differ == []
    # d2 had requests running when told to stop, and finished them: the stream we started on it
    # before the signal is whole and token-exact.
    assert drained, d2_drain.shutdown_log
    assert running_ids == running_ref
    # The prompt p2 held when told to stop was pulled from it while it drained (no pull failed),
    # token-exact; p2 exited holding nothing, every lease released by a pull, none expired.
    assert late_answer.token_ids == late_ref
    assert p2["pull_failures"] == 0
    assert p2["released"] >= 1 and p2["expired"] == 0 and p2["held_leases_at_exit"] == 0, p2
    for name, facts in (("p2", p2), ("d2", d2)):
        # Out of rotation at its first refusal, not when its record or its probes say so; done
        # before vLLM's deadline, then exited cleanly.
        assert facts["out_of_rotation_s"] < 5, (name, facts)
        assert facts["exit_code"] == 0 and not facts["killed_at_deadline"], (name, facts)


async def test_2p2d_survives_a_killed_prefill_and_decode_and_they_rejoin(xpyd):
    c = xpyd
    await _all_in_rotation(c)
    prompts = _prompts(seed=2, n=24, lo=100, hi=400)
    refs = await _references(c, prompts, max_tokens=24)
    bodies = [_body(c.model, p, i, max_tokens=24) for i, p in enumerate(prompts)]
    run = asyncio.create_task(_run(c.proxy.url, bodies))
    await asyncio.sleep(2.0)  # a few requests in flight, a few done
    kill_s = time.monotonic()
    await asyncio.to_thread(c.kill, "p2")
    await asyncio.to_thread(c.kill, "d2")
    results = await run
    answered = [i for i, (r, _) in enumerate(results) if not isinstance(r, Exception)]
    failed = {i: str(r) for i, (r, _) in enumerate(results) if isinstance(r, Exception)}
    print(f"\nkill run: {len(answered)} answered, {len(failed)} errors: {failed}")
    print(f"slowest client {max(t for _, t in results):.1f}s (deadline {PROXY_TIMEOUT_S:.0f}s)")
    # Every client got an answer or an error, within the proxy's deadline.
    assert len(answered) + len(failed) == len(prompts)
    assert all(t < PROXY_TIMEOUT_S + 5 for _, t in results)
    # Every answer is token-exact: a prefill leg cut on p2 was retried on p1, a decode leg that
    # could not reach d2 went to d1, and a pull from the dead p2 was recomputed by its decode.
    for i in answered:
        assert results[i][0].token_ids == refs[i], f"request {i} differs from plain"
    # The only requests that may fail are those whose decode leg was on d2 when it died: the
    # proxy cannot repeat a decode leg it has started (the prompt's KV was pulled once), and a
    # stream cannot be resumed. At most the concurrency of them, and each error says so.
    d2 = c.engines["d2"].url
    for i, message in failed.items():
        assert f"decode backend {d2} dropped the connection" in message, (i, message)
    assert len(failed) <= CONCURRENCY

    # The killed engines leave the pools when their records expire.
    await asyncio.to_thread(
        c.proxy.wait_for, "p2 and d2 left the pools",
        lambda: _pools_are(c, prefill=("p1",), decode=("d1",))
        and c.proxy.pool("prefill") == {c.engines["p1"].url}
        and c.proxy.pool("decode") == {c.engines["d1"].url},
        3 * METADATA_TTL_S + 5,
    )  # fmt: skip
    print(f"p2 and d2 left the pools {time.monotonic() - kill_s:.1f}s after the kill")

    # Later requests succeed on the survivors, which pull without failures...
    later = _prompts(seed=3, n=8)
    later_refs = await _references(c, later)
    before = _counters(c)
    results = await _run(c.proxy.url, [_body(c.model, p, i) for i, p in enumerate(later)])
    assert [getattr(r, "token_ids", r) for r, _ in results] == later_refs
    after = _counters(c)
    assert _delta(after, before, "d1", "pulls") == 8
    assert _delta(after, before, "d1", "pull_failures") == 0
    assert _delta(after, before, "p1", "requests") == 8
    # ... and whose KV usage returns to zero (prompts left for the killed decode expire).
    for name in ("p1", "d1"):
        waited = await eventually(
            lambda n=name: _nothing_held(c.servers[n]), LEASE_TTL_S + 15, f"{name} holds KV"
        )
        print(f"{name} back to 0 KV in use {waited:.1f}s after the later requests")

    # p2 and d2 stay down: the next test to run, if any, starts them again (_all_in_rotation).
