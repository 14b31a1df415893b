"""The setup a new user tries first, under load: both engines on one address (127.0.0.1, ports far
apart), P2P handshake over TCP, vLLM's default ``kv_load_failure_policy`` (``fail``: a failed pull
is an error for the client), a plain vLLM with default flags beside the pair (its worker busy-waits
after every request), a model of another shape than the suite's (3 layers, 3 KV heads × 32), and
requests through ``python proxy/proxy_server.py`` at concurrency 8, streamed and not. The pair is
started with vLLM's own command, as vLLM's and Mooncake's guides write it:

    MOONCAKE_CONFIG_PATH=mooncake.json vllm serve MODEL \\
        --kv-transfer-config '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}'

(Prefill and decode on two addresses is the shared cluster's layout, which the other e2e modules
use.) Also: what vLLM's ``pause_generation`` (``POST /pause``, ``VLLM_SERVER_DEV_MODE=1``) does to
a prefill that holds a lease: the pause waits until the lease ends, the blocks are never freed
under it, and after ``/resume`` the pair hands KV over as before.

A handover is proven by token equality with the plain server *and* by the decode's counters: the
prompt tokens arrived by external transfer, and no pull failed (a recompute would hide one).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
import uuid
from pathlib import Path

import pytest
from test_connector_e2e import assert_failed_load

from harness import servers
from harness.faults import freeze_after_grant_env
from harness.pd import (
    PULL_COUNTERS,
    ServerSpec,
    client_session,
    complete,
    eventually,
    pulls_since,
    readme_pair,
    start_many,
    tokens_by_transfer,
)
from harness.tiny_model import TinyModelSpec, build_tiny_model
from harness.xpyd import start_pair_proxy

pytestmark = pytest.mark.servers

HOST = "127.0.0.1"
# Not the suite's Llama: 3 layers, 6 query heads over 3 KV heads of 32 (GQA).
MODEL_SPEC = TinyModelSpec(layers=3, hidden=192, heads=6, kv_heads=3, head_dim=32,
                           intermediate=384, seed=4321)  # fmt: skip
LOAD_TIMEOUT_S = 8.0
# A lease nobody pulls (the idle and pause tests') ends this long after its grant: past the idle
# test's window (~6 s), not the default 30 s that the tests would then wait out.
LEASE_TTL_S = 10.0
CONCURRENCY, MAX_TOKENS = 8, 8
BLOCK = 128  # vLLM's CPU block size


class NewUser:
    def __init__(self, model, plain, prefill, decode, proxy_url, freeze_trigger=None):
        self.model, self.plain, self.prefill, self.decode = model, plain, prefill, decode
        self.proxy = proxy_url
        # Created by a test: the prefill's next grant freezes its worker (harness.faults).
        self.freeze_trigger: Path | None = freeze_trigger


@contextlib.contextmanager
def _serving(model: str, specs: list[ServerSpec], tag: str):
    """Starts ``specs`` (the pair last) and ``python proxy/proxy_server.py`` in front of the
    pair; yields the servers and the proxy's URL, and stops them all however the block ends."""
    started = start_many(model, specs)
    with contextlib.ExitStack() as stack:
        for srv in started:
            stack.enter_context(servers.running(srv))
        prefill, decode = started[-2:]
        proxy = stack.enter_context(servers.running(start_pair_proxy(prefill.url, decode.url)))
        yield started, proxy.url


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = str(build_tiny_model(spec=MODEL_SPEC))
    cfg = tmp_path_factory.mktemp("new-user") / "mooncake.json"
    trigger = cfg.with_name("freeze-after-grant")
    specs = [
        ServerSpec("plain-default", HOST),
        *readme_pair(
            cfg,
            "1host",
            HOST,
            env={"VLLM_SERVER_DEV_MODE": "1"},  # /pause and /resume
            cli=True,
            prefill_env=freeze_after_grant_env(trigger),
            prefill_url=f"{HOST}:14100",
            decode_url=f"{HOST}:14200",
            load_timeout_s=LOAD_TIMEOUT_S,
            lease_ttl_s=LEASE_TTL_S,
        ),
    ]
    with _serving(model, specs, "1host") as ((plain, prefill, decode), url):
        yield NewUser(model, plain, prefill, decode, url, freeze_trigger=trigger)


@pytest.fixture
def show_logs(request):
    yield
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        pair = request.getfixturevalue("setup")
        for srv in (pair.prefill, pair.decode):
            print(f"\n===== log of {srv.process.name} =====\n{srv.process.log_tail(40_000)}")


def nothing_held(srv) -> bool:
    return srv.metric("mooncake_vllm:held_leases") == 0 and srv.metric(
        "vllm:kv_cache_usage_perc"
    ) == pytest.approx(0.0, abs=1e-9)


async def test_concurrent_requests_through_the_proxy_all_arrive_by_transfer(setup, show_logs):
    for srv in (setup.prefill, setup.decode):
        assert srv.process.argv[1:3] == ["serve", setup.model]  # vllm serve MODEL ...
    await _two_hundred_requests(setup)


async def _two_hundred_requests(setup: NewUser) -> None:
    """200 mixed-length requests at concurrency 8 through the proxy, streamed and not, each
    beside the same request to the plain server: all answered, token-equal, every prompt pulled
    once, whole and at the first attempt (no failed pull, no entry read again or stalled, every
    prompt token by transfer), nothing held afterwards."""
    rng = random.Random(2026)
    # Mixed: half short (1-199 tokens), half long (200-1499).
    lengths = [rng.randrange(1, 200) if i % 2 else rng.randrange(200, 1500) for i in range(200)]
    d = setup.decode
    before, ext0 = PULL_COUNTERS.read(d), tokens_by_transfer(d)
    failures: list[str] = []
    mismatches: list[int] = []
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int, n: int, http) -> None:
        prompt = [rng.randrange(3, 2048) for _ in range(n)]
        body = {"model": setup.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        async with gate:
            try:
                # The plain server works beside the pair, as in the report.
                ref, got = await asyncio.gather(
                    complete(http, setup.plain, body),
                    complete(http, setup.proxy, {**body, "stream": i % 2 == 1}),
                )
            except Exception as e:  # every failure is reported below, with its message
                failures.append(f"request {i} ({n} tokens): {e}")
                return
        if got.token_ids != ref.token_ids:
            mismatches.append(n)

    async with client_session() as http:
        await asyncio.gather(*(one(i, n, http) for i, n in enumerate(lengths)))
    assert not failures, f"{len(failures)} of {len(lengths)} failed: {failures[:5]}"
    assert not mismatches, f"decode differs from plain for prompts of {mismatches} tokens"

    pulled = await pulls_since(d, before, len(lengths), 20)
    ext = tokens_by_transfer(d) - ext0
    print(f"decode: {pulled}; {ext:.0f} of {sum(lengths)} prompt tokens by transfer")
    blocks = sum(-(-n // BLOCK) for n in lengths)
    s = MODEL_SPEC  # float32 K and V per layer, KV head and token; whole blocks
    kv_block_bytes = BLOCK * s.layers * s.kv_heads * 2 * s.head_dim * 4
    assert pulled == {
        "pulls": len(lengths),
        "pull_failures": 0,
        "blocks": blocks,
        "bytes": blocks * kv_block_bytes,
        "retries": 0,
        "stalls": 0,
    }
    # The consumer claims the whole prompt and vLLM counts it as external, except a one-token
    # prompt's: vLLM computes the last token again after a load, which leaves that request with
    # nothing computed, so it schedules it afresh and counts no token by transfer.
    assert ext == sum(n for n in lengths if n > 1)
    await eventually(lambda: nothing_held(setup.prefill), 20)
    await eventually(lambda: nothing_held(setup.decode), 20)


async def test_idle_pair_with_a_held_lease_and_a_waiting_pull_costs_almost_no_cpu(setup, show_logs):
    """A prefill that holds a lease and a decode whose pull waits for an acquire nobody answers
    (a side channel that never replies) use at most 3 % of a core more than the idle plain vLLM
    beside them, once vLLM's own post-request busy-wait (1 s) is over."""
    import zmq

    mute_port = servers.free_port(HOST)
    mute = zmq.Context.instance().socket(zmq.ROUTER)
    mute.bind(f"tcp://{HOST}:{mute_port}")  # takes acquires, never answers
    try:
        async with client_session() as http:
            prompt = list(range(3, 603))
            body = {"model": setup.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            params = {"do_remote_decode": True, "transfer_id": str(uuid.uuid4())}
            head = await complete(
                http, setup.prefill, {**body, "max_tokens": 1, "kv_transfer_params": params}
            )
            await eventually(lambda: setup.prefill.metric("mooncake_vllm:held_leases") == 1, 5.0)
            mangled = {**head.kv_transfer_params, "side_channel_ports": [mute_port]}
            failures0 = setup.decode.metric("mooncake_vllm:pull_failures_total")
            waiting = asyncio.ensure_future(
                http.post(
                    f"{setup.decode.url}/v1/completions",
                    json={**body, "kv_transfer_params": mangled},
                )
            )
            await asyncio.sleep(1.5)  # vLLM's busy-wait after the last step ends
            # The idle plain vLLM beside them is the baseline: on a shared 2-core box its own
            # idle cost (API server, worker, gloo threads) moves by a few % of a core.
            engines = {"prefill": setup.prefill, "decode": setup.decode, "plain": setup.plain}
            t0 = time.monotonic()
            before = {k: e.process.thread_cpu_s() for k, e in engines.items()}
            await asyncio.sleep(6.0)
            wall = time.monotonic() - t0
            after = {k: e.process.thread_cpu_s() for k, e in engines.items()}
            share = {k: (sum(after[k].values()) - sum(before[k].values())) / wall for k in engines}
            where = {
                k: servers.ManagedProcess.busiest_threads(before[k], after[k]) for k in engines
            }
            assert not waiting.done(), "the decode's pull should still be waiting"
            print("idle CPU (core): " + ", ".join(f"{k} {v:.3f}" for k, v in share.items()))
            print(f"idle CPU by thread: {where}")
            async with await waiting as resp:  # vLLM's default policy: the pull's error
                status, text = resp.status, await resp.text()
        # A spinning thread would cost 50-100 % of a core; ours stays within 3 % of the plain's.
        for role, doing in (("prefill", "holding a lease"), ("decode", "waiting on a pull")):
            assert share[role] < share["plain"] + 0.03, (
                f"{role} used {share[role]:.1%} of a core {doing}, the idle plain vLLM "
                f"{share['plain']:.1%}: {where[role]}"
            )
        assert_failed_load(status, text)
        assert setup.decode.metric("mooncake_vllm:pull_failures_total") == failures0 + 1
    finally:
        mute.close()
    # The lease the decode never pulled expires or is released; nothing stays held.
    await eventually(lambda: nothing_held(setup.prefill), timeout_s=60)


async def test_pause_waits_for_a_held_lease_and_resume_serves_again(setup, show_logs):
    prefill, decode = setup.prefill, setup.decode
    prompt = list(range(7, 507))
    body = {"model": setup.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with client_session() as http:
        params = {"do_remote_decode": True, "transfer_id": str(uuid.uuid4())}
        await complete(http, prefill, {**body, "max_tokens": 1, "kv_transfer_params": params})
        held = await eventually(lambda: prefill.metric("mooncake_vllm:held_leases") == 1, 5)
        # Nobody pulls: the pause completes only when the lease expires and vLLM frees the
        # request's blocks (an aborted running request would be freed at once).
        t0 = time.monotonic()
        async with http.post(f"{prefill.url}/pause", params={"mode": "abort"}) as resp:
            assert resp.status == 200, await resp.text()
        paused_after_s = time.monotonic() - t0
        try:
            assert prefill.metric("mooncake_vllm:held_leases") == 0
            assert paused_after_s >= LEASE_TTL_S - held - 1.0, paused_after_s
        finally:
            async with http.post(f"{prefill.url}/resume") as resp:
                assert resp.status == 200, await resp.text()
        before = PULL_COUNTERS.read(decode)
        ref = await complete(http, setup.plain, body)
        got = await complete(http, setup.proxy, body)
        assert got.token_ids == ref.token_ids
    pulls = await pulls_since(decode, before, 1)
    assert (pulls["pulls"], pulls["pull_failures"]) == (1, 0)
    print(f"pause returned after {paused_after_s:.1f} s (lease TTL {LEASE_TTL_S} s)")


async def test_a_producer_frozen_after_granting_ends_the_pull_by_the_deadline(setup, show_logs):
    """The producer's worker stops (SIGSTOP) once it granted the acquire: the decode's pull
    stalls, and the request still ends (an error: default policy) within load_timeout_s + 1 s.
    Entries still in flight then keep the destination blocks pinned until they end (after the
    producer is thawed), so the decode holds nothing only afterwards.

    The harness (``harness.faults``, armed by the trigger file) freezes the worker before the
    grant leaves the producer, so no read can beat it."""
    prompt = list(range(5, 1905))
    body = {"model": setup.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    failures0 = setup.decode.metric("mooncake_vllm:pull_failures_total")
    async with client_session() as http:
        params = {"do_remote_decode": True}
        head = await complete(
            http, setup.prefill, {**body, "max_tokens": 1, "kv_transfer_params": params}
        )
        setup.freeze_trigger.touch()  # the decode's acquire is the next grant
        try:
            t0 = time.monotonic()
            async with http.post(
                f"{setup.decode.url}/v1/completions",
                json={**body, "kv_transfer_params": head.kv_transfer_params},
            ) as resp:
                text = await resp.text()
            elapsed = time.monotonic() - t0
            usage = setup.decode.metric("vllm:kv_cache_usage_perc")
            await asyncio.sleep(0.5)
        finally:
            armed = setup.freeze_trigger.exists()
            setup.freeze_trigger.unlink(missing_ok=True)  # never freeze a later test's grant
            frozen = [pid for pid in setup.prefill.process.group_pids() if _state(pid) == "T"]
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
    assert not armed and frozen, "the harness should have frozen the prefill's worker"
    assert_failed_load(resp.status, text)  # vLLM's default policy: the pull's error
    print(f"frozen producer: the request ended after {elapsed:.2f}s; decode KV usage then "
          f"{usage:.3f} (blocks pinned under entries still in flight)")  # fmt: skip
    assert elapsed < LOAD_TIMEOUT_S + 1.0, f"the request took {elapsed:.2f}s"
    await eventually(
        lambda: setup.decode.metric("mooncake_vllm:pull_failures_total") == failures0 + 1, 20
    )
    # The thawed producer serves again, and its lease ends; the decode holds nothing.
    await eventually(lambda: nothing_held(setup.prefill), timeout_s=60)
    await eventually(lambda: nothing_held(setup.decode), 20)
    async with client_session() as http:
        ref = await complete(http, setup.plain, {**body, "prompt": prompt[:300]})
        got = await complete(http, setup.proxy, {**body, "prompt": prompt[:300]})
    assert got.token_ids == ref.token_ids


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
