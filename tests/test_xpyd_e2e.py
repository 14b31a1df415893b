"""2P2D end to end: two prefills and two decodes (real vLLMs on their own 127.0.0.x), one proxy.

The proxy is started the way the README's xPyD section says: one prefill given as a flag, the
other engines found in etcd (``--discover``), where each engine publishes its OpenAI URL. Then:

1. 40 requests at concurrency 4 are token-exact against a plain vLLM, every engine is used (its
   own counters), and every prompt is pulled from the prefill that computed it: each prefill's
   leases released by a decode's pull equal the prompts it computed, the decodes pulled once per
   request, no pull failed.
2. One prefill and one decode (both discovered) are SIGKILLed mid-run: every client gets an
   answer (token-exact) or an error within the proxy's deadline; the killed engines leave the
   pools when their registry records expire; later requests succeed on the survivors (one of
   them the static prefill), whose KV usage returns to zero; restarted, both rejoin by discovery
   and serve again. (A static backend's ejection and return by health probes is in
   ``test_proxy_faults``; here its probes back off up to 30 s while it is down.)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from harness import servers
from harness.pd import client_session, complete, eventually, kv_args
from harness.xpyd import ProxyServer, start_proxy

pytestmark = pytest.mark.servers

METADATA_TTL_S = 4.0  # a killed engine's record is gone this long after its last heartbeat
LEASE_TTL_S = 6.0  # a prefill frees a prompt nobody pulled (its decode was killed) this fast
LOAD_TIMEOUT_S = 8.0
PROXY_TIMEOUT_S = 60.0
MAX_TOKENS = 8
# Ports apart from the other e2e modules' engines (they may share a session with this one).
TE_PORT = 13403


@dataclass(frozen=True)
class Engine:
    name: str
    role: str
    host: str
    port: int  # the OpenAI server's

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
        # One process for engine core and worker: 4 engines + plain on 2 cores.
        return [*kv_args(self.role, extra, **top), "--distributed-executor-backend", "uni"]


ENGINES = [
    Engine("p1", "kv_producer", "127.0.0.21", 0),
    Engine("p2", "kv_producer", "127.0.0.22", 0),
    Engine("d1", "kv_consumer", "127.0.0.23", 0),
    Engine("d2", "kv_consumer", "127.0.0.24", 0),
]


class Cluster:
    def __init__(self, model: str, config_env: dict[str, str], etcd_url: str) -> None:
        self.model, self.env, self.etcd_url = model, config_env, etcd_url
        self.engines = {
            e.name: Engine(e.name, e.role, e.host, servers.free_port(e.host)) for e in ENGINES
        }
        self.servers: dict[str, servers.VllmServer] = {}
        self.plain: servers.VllmServer | None = None
        self.proxy: ProxyServer | None = None

    def start(self, names: list[str], with_plain: bool = False) -> float:
        """Start engines (and the plain reference) together; seconds until all are healthy."""
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(names) + 1) as pool:
            futures = {n: pool.submit(self._start_one, n) for n in names}
            if with_plain:
                futures["plain"] = pool.submit(
                    servers.start_vllm, self.model, name="xpyd-plain",
                    args=["--distributed-executor-backend", "uni"], timeout_s=900,
                )  # fmt: skip
            errors = []
            for n, f in futures.items():
                try:
                    srv = f.result()
                except Exception as e:
                    errors.append(e)
                    continue
                if n == "plain":
                    self.plain = srv
                else:
                    self.servers[n] = srv
        if errors:
            raise errors[0]
        return time.monotonic() - t0

    def _start_one(self, name: str) -> servers.VllmServer:
        e = self.engines[name]
        return servers.start_vllm(
            self.model, name=f"xpyd-{name}", host=e.host, port=e.port, args=e.args(),
            env=self.env, timeout_s=900,
        )  # fmt: skip

    def kill(self, name: str) -> None:
        """SIGKILL the engine's whole process group: no clean shutdown, its record stays."""
        srv = self.servers.pop(name)
        os.killpg(srv.process.proc.pid, signal.SIGKILL)
        srv.stop()

    def stop(self) -> None:
        for srv in [self.proxy, *self.servers.values(), self.plain]:
            if srv is not None:
                srv.stop()


@pytest.fixture(scope="module")
def xpyd(tiny_model, tmp_path_factory):
    etcd = servers.start_etcd()
    etcd_url = f"etcd://{etcd.host}:{etcd.port}"
    config = tmp_path_factory.mktemp("xpyd") / "mooncake.json"
    config.write_text(json.dumps({"metadata_server": etcd_url, "metadata_ttl_s": METADATA_TTL_S}))
    cluster = Cluster(tiny_model, {"MOONCAKE_CONFIG_PATH": str(config)}, etcd_url)
    failed = True
    try:
        start_s = cluster.start(list(cluster.engines), with_plain=True)
        print(f"\n4 engines + plain healthy in {start_s:.0f}s")
        p1 = cluster.engines["p1"]
        cluster.proxy = start_proxy(
            ["--prefill", p1.url, "--discover", etcd_url, "--health-interval-s", "1",
             "--timeout-s", str(PROXY_TIMEOUT_S), "--log-level", "info"]
        )  # fmt: skip
        cluster.proxy.wait_for("all four engines in rotation", lambda: _pools_are(cluster), 30)
        yield cluster
        failed = False
    finally:
        if failed:
            for srv in [cluster.proxy, *cluster.servers.values(), cluster.plain, etcd]:
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


def _prompts(seed: int, n: int, lo: int = 24, hi: int = 160) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _body(model: str, prompt: list[int], i: int, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": i % 2 == 1}  # fmt: skip


async def _run(url, bodies, concurrency: int = 4) -> list[tuple[object, float]]:
    """Every body through ``url`` at ``concurrency``: (Answer or the error, seconds) each."""
    sem = asyncio.Semaphore(concurrency)
    async with client_session(total_timeout_s=PROXY_TIMEOUT_S + 30) as http:

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


async def test_2p2d_survives_a_killed_prefill_and_decode_and_they_rejoin(xpyd):
    c = xpyd
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
    # Every client got an answer (token-exact) or a clear error, within the proxy's deadline.
    assert all(t < PROXY_TIMEOUT_S + 5 for _, t in results)
    for i in answered:
        assert results[i][0].token_ids == refs[i], f"request {i} differs from plain"
    for message in failed.values():
        assert "HTTP 50" in message or "stream error" in message, message
    assert answered, "no request survived the kills"

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

    # Restarted, both rejoin by their new registry records.
    restart_s = await asyncio.to_thread(c.start, ["p2", "d2"])
    rejoin_s = await asyncio.to_thread(
        c.proxy.wait_for, "p2 and d2 back in rotation", lambda: _pools_are(c), 15
    )
    print(f"restart: healthy in {restart_s:.0f}s, in the proxy's rotation {rejoin_s:.1f}s later")
    before = _counters(c)
    again = _prompts(seed=4, n=8)
    again_refs = await _references(c, again)
    results = await _run(c.proxy.url, [_body(c.model, p, i) for i, p in enumerate(again)])
    assert [getattr(r, "token_ids", r) for r, _ in results] == again_refs
    after = _counters(c)
    deltas = {n: {k: _delta(after, before, n, k) for k in after[n]} for n in after}
    print(f"after the restart: counter deltas {deltas}")
    # Both serve again. A pull from the restarted p2 may fail (and be recomputed, token-exact)
    # until its peers refresh its transfer-engine metadata (5 s, see the README's Metadata).
    assert deltas["p2"]["requests"] > 0 and deltas["d2"]["requests"] > 0
