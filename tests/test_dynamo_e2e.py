"""NVIDIA Dynamo 1.6.1's own frontend and vLLM workers (``harness.dynamo``) serving our connector,
under vLLM's default ``fail`` policy, every process on one address: Dynamo's prefill worker gives
its request a bare-UUID transfer id and, once it has answered, hands the decode worker the
bootstrap address (``bootstrap_server_address``) and engine id; the decode pulls. Each flow:
completions of 1-1500 tokens and chats, streamed and not, concurrency 8, every answer's text
equal to a plain vLLM's by token ids (Dynamo refuses vLLM's ``return_token_ids`` and answers
``nvext.extra_fields: ["completion_token_ids"]``; its text can differ from vLLM's where a token
is a partial UTF-8 sequence, so text is not compared), every completion's prompt by
transfer, one pull per request and none failed, every lease released. A 1P1D behind the
round-robin frontend, then a second pair joins (file discovery) for a 2P2D behind the same
frontend and behind Dynamo's KV router, and last a prefill killed under load.

``make test-dynamo`` makes Dynamo's venv and runs this module; elsewhere it is skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

pytest.importorskip("dynamo.frontend")

from test_upstream_e2e import MAX_TOKENS, answer_events, chat_body, prompts

from harness.dynamo import start_frontend, start_worker
from harness.pd import eventually, greedy_body, mooncake_json, reference_spec, start_many

pytestmark = pytest.mark.servers

HOST = "127.0.0.1"
PAIRS = {"a": (13503, 13512, 18998), "b": (13523, 13532, 18999)}  # prefill, decode, bootstrap
COUNTED = ("mooncake_pulls", "mooncake_pull_failures")
STATS_LINE = re.compile(r"KV Transfer metrics: (.*)$", re.M)


class Dyn:
    def __init__(self, model, discovery, tmp, plain):
        self.model, self.discovery, self.tmp, self.plain = model, discovery, tmp, plain
        self.prefills, self.decodes, self.frontend = [], [], None

    def start_pair(self, tag: str) -> None:
        """A prefill and a decode worker, the pair's own mooncake.json; the prefill's bootstrap
        on its own port, named by ``bootstrap_server_address`` (what Dynamo's prefill worker
        tells the decode), and vLLM's KV events on their own port."""
        p_port, d_port, bootstrap = PAIRS[tag]
        cfg = mooncake_json(self.tmp / f"mooncake-{tag}.json", prefill_url=f"{HOST}:{p_port}",
                            decode_url=f"{HOST}:{d_port}")  # fmt: skip
        env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
        extra = {"bootstrap_server_address": f"{HOST}:{bootstrap}"}
        events = ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
                  f'"endpoint": "tcp://{HOST}:{bootstrap + 1000}"}}']  # fmt: skip
        prefill = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                   "kv_connector_extra_config": extra}  # fmt: skip
        decode = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}
        self.prefills.append(
            start_worker(self.discovery, self.model, "prefill", prefill,
                         name=f"dynamo-prefill-{tag}", env=env, args=events)
        )  # fmt: skip
        self.decodes.append(
            start_worker(self.discovery, self.model, "decode", decode,
                         name=f"dynamo-decode-{tag}", env=env)
        )  # fmt: skip

    def stop(self) -> None:
        for proc in [self.frontend, *self.decodes, *self.prefills, self.plain]:
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="module")
def dyn(tiny_model, tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("dynamo")
    (discovery := tmp / "discovery").mkdir()
    (plain,) = start_many(tiny_model, [reference_spec("plain-dynamo")])
    d = Dyn(tiny_model, discovery, tmp, plain)
    try:
        d.start_pair("a")
        d.frontend = start_frontend(discovery, tiny_model)
        yield d
    finally:
        if request.session.testsfailed:
            for proc in [d.frontend, *d.prefills, *d.decodes]:
                if proc is not None:
                    print(f"\n===== {proc.process.name} ({proc.process.log_path}) =====")
                    print(proc.process.log_tail())
        d.stop()


def counters(decodes) -> dict[str, float]:
    out = {k: sum(d.metric(f"vllm:{k}_total") for d in decodes) for k in COUNTED}
    for source in ("external_kv_transfer", "local_cache_hit"):
        out[source] = sum(
            d.metric("vllm:prompt_tokens_by_source_total", source=source) for d in decodes
        )
    return out


def log_sizes(workers) -> list[int]:
    return [w.process.log_path.stat().st_size for w in workers]


def prefill_leases(prefills, sizes) -> tuple[int, list[int | None]]:
    """Leases released since ``sizes`` (``log_sizes``) and each prefill's newest held count,
    from vLLM's ``KV Transfer metrics`` log line (every 10 s): Dynamo's prefill worker serves
    no ``vllm:*`` series on its ``/metrics``."""
    released, held = 0, []
    for w, size in zip(prefills, sizes, strict=True):
        with open(w.process.log_path, "rb") as f:
            f.seek(size)
            lines = [dict(kv.split("=", 1) for kv in m.group(1).split(", "))
                     for m in STATS_LINE.finditer(f.read().decode(errors="replace"))]  # fmt: skip
        released += sum(int(d.get("released", 0)) for d in lines)
        held.append(int(lines[-1]["held_leases"]) if lines else None)
    return released, held


def idle(decodes) -> bool:
    return all(
        d.metric("vllm:num_requests_running") == 0
        and d.metric("vllm:kv_cache_usage_perc") == pytest.approx(0.0, abs=1e-9)
        for d in decodes
    )


async def read_ids(resp) -> list[int]:
    """The answer's token ids, streamed or not: vLLM's ``choices[].token_ids``
    (``return_token_ids``) or Dynamo's ``nvext.completion_token_ids``; an error event raises."""
    if resp.status != 200:
        async with resp:
            raise AssertionError(f"HTTP {resp.status}: {await resp.text()}")
    ids: list[int] = []
    for event in await answer_events(resp):
        assert "error" not in event, event
        for choice in event.get("choices", []):
            ids.extend(choice.get("token_ids") or [])
        ids.extend((event.get("nvext") or {}).get("completion_token_ids") or [])
    return ids


NVEXT = {"nvext": {"extra_fields": ["completion_token_ids"]}}


def jobs_of(model: str, seed: int) -> list[tuple[str, dict]]:
    batch = prompts(seed, [1, 127, 128, 129, 300, 640, 1000, 1500] * 2)
    return [
        ("/v1/completions", greedy_body(model, p, MAX_TOKENS, stream=i % 2 == 1))
        for i, p in enumerate(batch)
    ] + [
        ("/v1/chat/completions", chat_body(model, f"say {seed} {w} things", stream=w % 2 == 1))
        for w in range(4)
    ]  # fmt: skip


async def want_of(dyn, http, jobs) -> list:
    out = []
    for api, body in jobs:
        plain = {**body, "stream": False, "return_token_ids": True}
        out.append(await read_ids(await http.post(dyn.plain.url + api, json=plain)))
    return out


async def through(dyn, http, frontend, seed: int) -> dict[str, float]:
    """``jobs_of(seed)`` at c=8 through ``frontend``: each answer the plain vLLM's, every
    completion's prompt by transfer, one pull per request and none failed, each lease released;
    returns how far the decodes' counters moved and the requests each decode served."""
    jobs = jobs_of(dyn.model, seed)
    want = await want_of(dyn, http, jobs)
    before, sizes = counters(dyn.decodes), log_sizes(dyn.prefills)
    served0 = [d.metric("vllm:request_success_total") for d in dyn.decodes]
    sem = asyncio.Semaphore(8)

    async def one(api, body):
        async with sem:
            return await read_ids(await http.post(frontend.url + api, json={**body, **NVEXT}))

    got = await asyncio.gather(*(one(a, b) for a, b in jobs))
    unequal = [(jobs[i][0], g, w) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not unequal, unequal

    def moved() -> dict[str, float]:
        return {k: v - before[k] for k, v in counters(dyn.decodes).items()}

    await eventually(lambda: moved()["mooncake_pulls"] >= len(jobs), 15, "every pull counted")
    out = moved()
    assert (out["mooncake_pulls"], out["mooncake_pull_failures"]) == (len(jobs), 0), out

    def released() -> bool:
        n, held = prefill_leases(dyn.prefills, sizes)
        return n >= len(jobs) and all(h == 0 for h in held)

    await eventually(released, 30, "every lease released, nothing held (the prefills' logs)")
    out["released"] = prefill_leases(dyn.prefills, sizes)[0]
    completions = [b["prompt"] for a, b in jobs if a == "/v1/completions"]
    total = sum(len(p) for p in completions)
    # vLLM may count each prompt's last token as computed; the chats' prompts come on top.
    assert out["external_kv_transfer"] >= 0.99 * (total - len(completions)), out
    await eventually(lambda: idle(dyn.decodes), 15, "decodes idle")
    out["decodes"] = [
        d.metric("vllm:request_success_total") - s0
        for d, s0 in zip(dyn.decodes, served0, strict=True)
    ]
    return out


async def test_dynamos_frontend_and_workers_serve_the_pair_token_equal_by_transfer(dyn, http):
    t0 = time.monotonic()
    out = await through(dyn, http, dyn.frontend, seed=83)
    print(f"dynamo 1P1D round-robin: {out} in {time.monotonic() - t0:.1f}s")
    assert out["decodes"] == [20]


async def test_our_counters_show_on_dynamos_worker_metrics_under_vllms_names(dyn):
    """Dynamo's worker ``/metrics`` passes on only ``vllm:*`` and ``lmcache:*`` series: ours
    are there as ``vllm:mooncake_*``, the old ``mooncake_vllm:*`` names are not."""
    from harness.servers import http_text

    text = http_text(f"{dyn.decodes[0].url}/metrics")
    assert "vllm:mooncake_pulls_total{" in text and "vllm:mooncake_pull_duration_seconds" in text
    assert "mooncake_vllm:" not in text


@pytest.fixture(scope="module")
def two_pairs(dyn):
    dyn.start_pair("b")
    return dyn


@pytest.mark.parametrize("mode", ["round-robin", "kv"])
async def test_a_second_pair_joins_and_dynamo_spreads_a_2p2d(two_pairs, http, mode):
    dyn = two_pairs
    frontend = dyn.frontend if mode == "round-robin" else start_frontend(
        dyn.discovery, dyn.model, router_mode="kv"
    )  # fmt: skip
    try:
        await eventually(lambda: frontend_sees(frontend, dyn), 60, "both pairs registered")
        out = await through(dyn, http, frontend, seed={"round-robin": 89, "kv": 97}[mode])
        print(f"dynamo 2P2D {mode}: {out}")
        assert min(out["decodes"]) > 0, out
    finally:
        if frontend is not dyn.frontend:
            frontend.stop()


def frontend_sees(frontend, dyn) -> bool:
    """Whether ``frontend`` routes to both decodes yet: a probe per decode's worth of
    requests, each answered (the decodes' success counts both move)."""
    import urllib.request

    before = [d.metric("vllm:request_success_total") for d in dyn.decodes]
    for _ in range(4):
        body = greedy_body(dyn.model, [5, 6, 7], 1)
        req = urllib.request.Request(
            f"{frontend.url}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
    after = [d.metric("vllm:request_success_total") for d in dyn.decodes]
    return all(a > b for a, b in zip(after, before, strict=True))


async def test_a_prefill_killed_under_load_what_dynamos_clients_see(two_pairs, http):
    """24 requests of 600-1500 tokens at c=8 through the round-robin frontend; prefill b is
    killed (SIGKILL to its process group) once the first answer is back. No request hangs;
    every answer that comes back is the plain vLLM's; then the frontend answers every request
    again. The statuses are printed (docs/compatibility.md)."""
    dyn = two_pairs
    jobs = [("/v1/completions", greedy_body(dyn.model, p, MAX_TOKENS))
            for p in prompts(101, [600, 900, 1200, 1500] * 6)]  # fmt: skip
    want = await want_of(dyn, http, jobs)
    sem, first = asyncio.Semaphore(8), asyncio.Event()
    outcome: list[tuple[int, object]] = [(0, "")] * len(jobs)

    async def one(i, api, body):
        async with sem:
            resp = await http.post(dyn.frontend.url + api, json={**body, **NVEXT})
            status = resp.status
            try:
                got = await read_ids(resp)
            except AssertionError as e:  # an error status or event: what the client sees
                got = str(e)
                status = status if status != 200 else -1
        outcome[i] = (status, got)
        first.set()

    tasks = [asyncio.create_task(one(i, a, b)) for i, (a, b) in enumerate(jobs)]
    await asyncio.wait_for(first.wait(), 120)
    os.killpg(dyn.prefills[1].process.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 300)
    took = time.monotonic() - t0
    statuses = [s for s, _ in outcome]
    ok = [i for i, (s, _) in enumerate(outcome) if s == 200]
    assert all(outcome[i][1] == want[i] for i in ok)
    errors = {s: str(g)[:300] for s, g in outcome if s != 200}
    print(f"prefill killed: statuses {statuses}; rest ended {took:.1f}s later; {errors}")
    t0, healed = time.monotonic(), False
    while not healed and time.monotonic() - t0 < 120:
        again = []
        for api, body in jobs[:4]:
            resp = await http.post(dyn.frontend.url + api, json={**body, **NVEXT})
            try:
                again.append(await read_ids(resp))
            except AssertionError:
                again.append(None)
        healed = again == want[:4]
        if not healed:
            await asyncio.sleep(2)
    print(f"every request answered again {time.monotonic() - t0:.1f}s after the rest ended")
    assert healed
