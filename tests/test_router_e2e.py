"""vLLM's Rust router (``vllm-router`` 0.1.17 from PyPI, ``harness.router``) in front of real
pairs of our connector, under vLLM's default ``fail`` policy: the README's pair and a 2P2D, the
router's ``mooncake`` mode (it asks each prefill's bootstrap ``/query`` and sends both legs at
once), its ``nixl`` mode (it hands the prefill's answer to the decode), and ``kv_aware`` prefill
routing on the prefills' KV events (``--pd-kv-events``). Each flow: completions of 1-1500 tokens
and chats, streamed and not, concurrency 8, every answer equal to a plain vLLM's, every prompt
token by transfer (local prefix-cache hits counted apart), no pull failed, nothing held. Then a
third prefill on prefill a's host with only the README's settings (it starts without a bootstrap)
in our proxy's 2P2D; last, a prefill killed under load: what the router's clients see.

``make test-router`` installs the router in its own venv and runs this module (about 3 minutes:
six vLLM starts); elsewhere it is skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
from test_concurrent_e2e import nothing_held
from test_upstream_e2e import MAX_TOKENS, chat_body, prompts, read_answer

from harness.pd import (
    PULL_COUNTERS,
    ServerSpec,
    eventually,
    greedy_body,
    kv_args,
    mooncake_json,
    reference_spec,
    start_many,
    stop_servers,
)
from harness.router import ROUTER_ENV, pd_args, router_binary, start_router
from harness.servers import http_json
from harness.xpyd import start_proxy

pytestmark = [
    pytest.mark.servers,
    pytest.mark.skipif(router_binary() is None, reason=f"{ROUTER_ENV} names no vllm-router"),
]

BOOTSTRAP_PORT = 8998  # the default: each prefill on its own address
SOURCES = ("external_kv_transfer", "local_cache_hit")


def events_config(host: str) -> list[str]:
    """vLLM's KV events on ZMQ, published on the engine's own address."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{host}:15557"}
    return ["--kv-events-config", json.dumps(cfg)]


class Cluster:
    def __init__(self, model, started):
        self.model = model
        self.plain, self.prefill_a, self.decode_a, self.prefill_b, self.decode_b = started[:5]
        self.prefill_c = started[5]  # on prefill a's host, no bootstrap of its own

    @property
    def prefills(self):
        return [self.prefill_a, self.prefill_b]

    @property
    def decodes(self):
        return [self.decode_a, self.decode_b]


@pytest.fixture(scope="module")
def rc(tiny_model, tmp_path_factory, request):
    """A plain vLLM and two README pairs (prefill 127.0.0.2 / decode 127.0.0.3, and 127.0.0.4 /
    127.0.0.5), each pair with its own mooncake.json, the prefills publishing KV events."""
    tmp = tmp_path_factory.mktemp("router")
    specs = [reference_spec("plain-router")]
    for tag, (p, d) in {"a": ("127.0.0.2", "127.0.0.3"), "b": ("127.0.0.4", "127.0.0.5")}.items():
        cfg = mooncake_json(tmp / f"mooncake-{tag}.json", prefill_url=f"{p}:13403",
                            decode_url=f"{d}:13412")  # fmt: skip
        env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
        specs.append(ServerSpec(f"prefill-router-{tag}", p,
                                [*kv_args("kv_producer"), *events_config(p)], env))  # fmt: skip
        specs.append(ServerSpec(f"decode-router-{tag}", d, kv_args("kv_consumer"), env))
    started = start_many(tiny_model, specs)
    # A second producer on prefill a's host with nothing but the README's settings, started
    # after it (so the bootstrap port 8998 stays prefill a's): it starts without a bootstrap.
    cfg = mooncake_json(tmp / "mooncake-c.json", prefill_url="127.0.0.2:13423",
                        decode_url="127.0.0.3:13432")  # fmt: skip
    try:
        env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
        spec = ServerSpec("prefill-router-c", "127.0.0.2", kv_args("kv_producer"), env)
        started += start_many(tiny_model, [spec])
    except BaseException:
        stop_servers(started, print_logs=True)
        raise
    yield Cluster(tiny_model, started)
    stop_servers(started, print_logs=request.session.testsfailed > 0)


def by_source(servers) -> dict[str, float]:
    return {
        s: sum(srv.metric("vllm:prompt_tokens_by_source_total", source=s) for srv in servers)
        for s in SOURCES
    }


def served(servers) -> list[float]:
    return [srv.metric("vllm:request_success_total") for srv in servers]


def jobs_of(model: str, seed: int) -> list[tuple[str, dict]]:
    batch = prompts(seed, [1, 127, 128, 129, 300, 640, 1000, 1500] * 2)
    jobs = [
        ("/v1/completions", greedy_body(model, p, MAX_TOKENS, stream=i % 2 == 1,
                                        return_token_ids=True))
        for i, p in enumerate(batch)
    ] + [
        ("/v1/chat/completions", chat_body(model, f"say {seed} {w} things", stream=w % 2 == 1))
        for w in range(4)
    ]  # fmt: skip
    return jobs


async def through_router(rc, http, router, seed, prefills, decodes) -> dict:
    """``jobs_of(seed)`` at concurrency 8 through ``router``: each answer the plain vLLM's, every
    completion's prompt by transfer or the decode's own prefix cache, one pull per request and
    none failed, nothing held. Returns requests served per prefill and per decode."""
    jobs = jobs_of(rc.model, seed)
    want = []
    for api, body in jobs:
        resp = await http.post(rc.plain.url + api, json={**body, "stream": False})
        want.append(await read_answer(resp, chat="chat" in api))
    src0, pulls0 = by_source(decodes), [PULL_COUNTERS.read(d) for d in decodes]
    p0, d0 = served(prefills), served(decodes)
    sem = asyncio.Semaphore(8)

    async def one(api, body):
        async with sem:
            return await read_answer(await http.post(router.url + api, json=body), "chat" in api)

    got = await asyncio.gather(*(one(a, b) for a, b in jobs))
    unequal = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not unequal, [(jobs[i][0], got[i], want[i]) for i in unequal]

    def moved():
        out = {"pulls": 0.0, "pull_failures": 0.0}
        for d, before in zip(decodes, pulls0, strict=True):
            since = PULL_COUNTERS.since(d, before)
            out = {k: out[k] + since[k] for k in out}
        return out

    await eventually(lambda: sum(moved().values()) >= len(jobs), 10, "every pull counted")
    assert moved() == {"pulls": len(jobs), "pull_failures": 0}
    src = {s: v - src0[s] for s, v in by_source(decodes).items()}
    completions = [b["prompt"] for a, b in jobs if a == "/v1/completions"]
    total = sum(len(p) for p in completions)
    # vLLM may count each prompt's last token as computed; the chats' prompts come on top.
    assert src["external_kv_transfer"] + src["local_cache_hit"] >= 0.99 * (total - len(completions))
    assert src["external_kv_transfer"] >= 0.9 * total, src
    await eventually(lambda: all(nothing_held(s) for s in [*prefills, *decodes]), 15, "freed")
    return {
        "prefills": [a - b for a, b in zip(served(prefills), p0, strict=True)],
        "decodes": [a - b for a, b in zip(served(decodes), d0, strict=True)],
        "by_source": src,
    }


@pytest.mark.parametrize("connector", ["mooncake", "nixl"])
async def test_the_router_drives_the_readme_pair_token_equal_by_transfer(rc, http, connector):
    port = BOOTSTRAP_PORT if connector == "mooncake" else None
    args = pd_args([(rc.prefill_a.url, port)], [rc.decode_a.url], connector)
    router = start_router([*args, "--policy", "round_robin"], name=f"router-{connector}")
    try:
        seed = {"mooncake": 61, "nixl": 67}[connector]
        t0 = time.monotonic()
        out = await through_router(rc, http, router, seed, [rc.prefill_a], [rc.decode_a])
        print(f"router {connector} 1P1D: {out} in {time.monotonic() - t0:.1f}s")
    finally:
        router.stop()


@pytest.mark.parametrize("policy", ["round_robin", "kv_aware"])
async def test_the_router_spreads_a_2p2d_and_every_prompt_is_pulled(rc, http, policy):
    """2P2D through the router's ``mooncake`` mode: round robin uses every engine; ``kv_aware``
    with ``--pd-kv-events`` routes prefills on the prefills' own KV events."""
    args = pd_args([(p.url, BOOTSTRAP_PORT) for p in rc.prefills],
                   [d.url for d in rc.decodes], "mooncake")  # fmt: skip
    if policy == "kv_aware":
        args += ["--prefill-policy", "kv_aware", "--decode-policy", "round_robin"]
        for p in rc.prefills:
            args += ["--pd-kv-events", f"{p.url}=tcp://{p.host}:15557"]
    else:
        args += ["--policy", "round_robin"]
    router = start_router(args, name=f"router-2p2d-{policy}")
    try:
        seed = {"round_robin": 71, "kv_aware": 73}[policy]
        out = await through_router(rc, http, router, seed, rc.prefills, rc.decodes)
        print(f"router 2P2D {policy}: {out}")
        if policy == "round_robin":
            assert out["prefills"] == [10, 10] and out["decodes"] == [10, 10], out
        else:
            assert min(out["decodes"]) > 0, out
    finally:
        router.stop()


async def test_two_producers_on_one_host_with_the_readme_settings_serve_our_proxys_2p2d(rc, http):
    """Prefill c shares prefill a's host and was given only the README's settings: it started,
    said once that it serves no bootstrap (the default port is prefill a's), and our proxy's
    2P2D over prefills a and c uses both, every answer the plain vLLM's, every prompt pulled."""
    log = rc.prefill_c.process.log_tail(500_000)
    assert log.count("This engine serves no bootstrap /query") == 1, log[-3000:]
    ids = {d["engine_id"] for d in http_json("http://127.0.0.2:8998/query").values()}
    assert len(ids) == 1  # prefill a's alone
    prefills = [rc.prefill_a, rc.prefill_c]
    args = [a for p in prefills for a in ("--prefill", p.url)]
    args += [a for d in rc.decodes for a in ("--decode", d.url)]
    proxy = start_proxy(args)
    try:
        out = await through_router(rc, http, proxy, 83, prefills, rc.decodes)
        print(f"our proxy, 2P2D with two producers on 127.0.0.2: {out}")
        assert min(out["prefills"]) > 0 and min(out["decodes"]) > 0, out
    finally:
        proxy.stop()


async def test_a_prefill_killed_under_load_what_the_routers_clients_see(rc, http):
    """2P2D, 24 requests at concurrency 8; prefill b is killed (SIGKILL to its process group)
    once the first answers are back. No request hangs: each ends within the router's time;
    every answer that comes back is the plain vLLM's. Measured (vllm-router 0.1.17): each
    request the router then sends to the dead prefill is a 500 at once ("Prefill request to
    ... failed ... Connection refused"), not retried on prefill a, until its health check takes
    prefill b out; then every request is answered again. The statuses are printed
    (docs/compatibility.md)."""
    args = pd_args([(p.url, BOOTSTRAP_PORT) for p in rc.prefills],
                   [d.url for d in rc.decodes], "mooncake")  # fmt: skip
    args += ["--policy", "round_robin", "--health-check-interval-secs", "2",
             "--health-failure-threshold", "1", "--request-timeout-secs", "60"]  # fmt: skip
    router = start_router(args, name="router-kill")
    jobs = [("/v1/completions", greedy_body(rc.model, p, MAX_TOKENS, return_token_ids=True))
            for p in prompts(79, [600, 900, 1200, 1500] * 6)]  # fmt: skip
    want = []
    for api, body in jobs:
        want.append(await read_answer(await http.post(rc.plain.url + api, json=body), False))
    sem, done = asyncio.Semaphore(8), asyncio.Event()
    outcome: list[tuple[int, tuple | str]] = [(0, "")] * len(jobs)

    async def one(i, api, body):
        async with sem, http.post(router.url + api, json=body) as resp:
            status = resp.status
            got = await read_answer(resp, False) if status == 200 else await resp.text()
        outcome[i] = (status, got)
        done.set()

    tasks = [asyncio.create_task(one(i, a, b)) for i, (a, b) in enumerate(jobs)]
    try:
        await asyncio.wait_for(done.wait(), 120)
        os.killpg(rc.prefill_b.process.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 180)
        took = time.monotonic() - t0
        statuses = [s for s, _ in outcome]
        ok = [i for i, (s, _) in enumerate(outcome) if s == 200]
        assert all(outcome[i][1] == want[i] for i in ok)
        errors = {s: str(g)[:200] for s, g in outcome if s != 200}
        print(f"prefill killed: statuses {statuses}; rest ended {took:.1f}s later; {errors}")
        assert len(ok) >= len(jobs) // 2, statuses
        # Then the router's health check (every 2 s here) takes prefill b out of rotation.
        t0, healed = time.monotonic(), False
        while not healed and time.monotonic() - t0 < 60:
            await asyncio.sleep(1)
            again = [await http.post(router.url + a, json=b) for a, b in jobs[:2]]
            healed = all(r.status == 200 for r in again)
            for r in again:
                r.release()
        print(f"every request answered again {time.monotonic() - t0:.1f}s after the rest ended")
        assert healed
        await eventually(lambda: all(nothing_held(s) for s in [rc.prefill_a, *rc.decodes]), 30)
    finally:
        router.stop()
