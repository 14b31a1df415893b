"""A prefill stopped under load, as users stop it: nothing a client sent is lost.

The README's pair (one ``mooncake.json``, P2P handshake over TCP, vLLM's default
``kv_load_failure_policy`` ``fail``) behind ``proxy/proxy_server.py``, each prefill started with
vLLM's ``--shutdown-timeout 30`` as ``vllm serve``. Requests run at concurrency 8; a few seconds
in, a prefill gets SIGTERM, either at its API server alone (``docker stop``, Kubernetes) or at
its whole process group (systemd's ``KillMode=control-group``, a terminal's Ctrl-C), or SIGKILL
at its group (it dies). Load goes on until the prefill has exited. Every request, sent before the
signal or after, must answer 200 with the tokens a decode computes for the prompt on its own (a
plain request: no handoff), which ``test_new_user_setup`` shows equal to a plain vLLM's.

- 1P1D: the requests the only prefill no longer admits are computed by the decode
  (``mooncake_proxy_dispatched_total{how="local"}``); the prefill is started again on its
  address for the next case, and the proxy takes it back.
- 2P2D: the other prefill takes them; no request is computed by a decode.

A drain serves every lease it granted (0 pull failures); a killed prefill's unpulled leases fail
their pulls and the proxy sends those requests again.

Ten vLLM starts: far past the suite's budget for one module, so it is marked ``long`` (``make
test-long``, or ``make test-drain`` for this module alone).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import servers
from harness.pd import client_session, complete, greedy_body, kv_args, mooncake_json
from harness.xpyd import start_pair_proxy, start_proxy

pytestmark = [pytest.mark.servers, pytest.mark.long]  # ten vLLM starts

HOST = "127.0.0.31"
SHUTDOWN_TIMEOUT_S = 30
CONCURRENCY = 8
MAX_TOKENS = 8
LOAD_BEFORE_SIGNAL_S = 4.0
# A drained engine core logs the start of its drain within a step of the signal (well under a
# second here); past this, the stacks of the prefill's processes are taken for the report.
DRAIN_START_S = 10.0
DRAIN_STARTED = "[shutdown] EngineCore: start mode=drain"


class Pair:
    def __init__(self, model: str, cfg: Path, log_dir: Path) -> None:
        self.model, self.cfg, self.log_dir = model, cfg, log_dir
        self.prefill_port = servers.free_port(HOST)
        self.decode: servers.VllmServer | None = None
        self.prefill: servers.VllmServer | None = None
        self.proxy = None

    def start_prefill(self) -> servers.VllmServer:
        self.prefill = servers.start_vllm(
            self.model,
            name="drain-prefill",
            host=HOST,
            port=self.prefill_port,
            args=[*kv_args("kv_producer"), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
            env={"MOONCAKE_CONFIG_PATH": str(self.cfg)},
            log_dir=self.log_dir,
            cli=True,
        )
        return self.prefill


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drain")
    cfg = mooncake_json(
        tmp / "mooncake.json", prefill_url=f"{HOST}:14300", decode_url=f"{HOST}:14310"
    )
    p = Pair(tiny_model, cfg, tmp)
    try:
        p.decode = servers.start_vllm(
            tiny_model,
            name="drain-decode",
            host=HOST,
            args=kv_args("kv_consumer"),
            env={"MOONCAKE_CONFIG_PATH": str(cfg)},
            log_dir=tmp,
            cli=True,
        )
        p.start_prefill()
        p.proxy = start_pair_proxy(p.prefill.url, p.decode.url)
        yield p
    finally:
        for srv in (p.proxy, p.prefill, p.decode):
            if srv is not None:
                srv.stop()


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(200, 900))] for _ in range(count)]


def _signal(proc: servers.ManagedProcess, target: str) -> None:
    """What stops the prefill: SIGTERM to its API server or to its whole process group (a
    drain), or SIGKILL to the group (it dies, nothing drains)."""
    if target == "api_server":
        os.kill(proc.proc.pid, signal.SIGTERM)
    elif target == "process_group":
        os.killpg(proc.proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.proc.pid, signal.SIGKILL)


@dataclass
class Episode:
    """One prefill stopped under load at concurrency 8, as the clients and counters saw it."""

    sent_before: int
    answers: dict[int, list[int]]
    unequal: list[int]
    errors: list[str]
    counts: dict[str, float]
    exit_s: float
    log: str
    stacks: str = ""  # the prefill's thread stacks, if its drain had not begun in time

    def summary(self, label: str) -> str:
        c = self.counts
        return (
            f"{label}: {self.sent_before} sent before the signal, "
            f"{len(self.answers) + len(self.errors)} in all, {len(self.answers)} answered, "
            f"{len(self.unequal)} unequal, {len(self.errors)} failed; local {c['local']:.0f}, "
            f"reloaded {c['reloaded']:.0f}, pulls {c['pulls']:.0f}, pull failures "
            f"{c['pull_failures']:.0f}; the prefill gone {self.exit_s:.1f}s after the signal"
        )


def _counts(proxy, decodes: list[servers.VllmServer]) -> dict[str, float]:
    return {
        "local": proxy.metric("mooncake_proxy_dispatched_total", how="local"),
        "reloaded": proxy.metric("mooncake_proxy_dispatched_total", how="reloaded"),
        "pulls": sum(d.metric("mooncake_vllm:pulls_total") for d in decodes),
        "pull_failures": sum(d.metric("mooncake_vllm:pull_failures_total") for d in decodes),
    }


async def _stop_under_load(
    model: str, proxy, prefill: servers.VllmServer, decodes: list[servers.VllmServer],
    target: str, seed: int,
) -> Episode:  # fmt: skip
    """Load through ``proxy`` until ``prefill``, stopped per ``target`` a few seconds in, has
    exited; every answer checked against the first decode computing the prompt itself."""
    prompts = _prompts(seed=seed, count=400)
    before = _counts(proxy, decodes)
    signalled_s: float | None = None
    exited = asyncio.Event()
    answers: dict[int, list[int]] = {}
    errors: list[str] = []
    sent_before = 0
    queue = iter(range(len(prompts)))
    proc = prefill.process
    log_offset = proc.log_path.stat().st_size  # the log holds the engine's earlier lives too

    sent_after = 0

    async def client(http) -> None:
        nonlocal sent_before, sent_after
        for i in queue:
            # Load goes on until the prefill is gone and a round of requests has been sent
            # after the signal: a SIGKILLed prefill is gone before the requests in flight at
            # the signal have ended, and what follows it must be answered too.
            if exited.is_set() and sent_after >= CONCURRENCY:
                return
            if signalled_s is None:
                sent_before += 1
            else:
                sent_after += 1
            body = greedy_body(model, prompts[i], MAX_TOKENS, stream=i % 2 == 1)
            try:
                answers[i] = (await complete(http, proxy.url, body)).token_ids
            except Exception as e:  # each one is reported below
                errors.append(f"request {i}: {e}")

    stacks = ""

    async def stop_prefill() -> float:
        nonlocal signalled_s, stacks
        await asyncio.sleep(LOAD_BEFORE_SIGNAL_S)
        signalled_s = time.monotonic()
        _signal(proc, target)
        watching = target != "killed"
        while proc.alive or proc.group_pids():
            if watching and time.monotonic() - signalled_s > DRAIN_START_S:
                watching = False
                if DRAIN_STARTED not in proc.log_path.read_bytes()[log_offset:].decode(
                    errors="replace"
                ):
                    stacks = await asyncio.to_thread(proc.dump_stacks)
            await asyncio.sleep(0.2)
        exited.set()
        return time.monotonic() - signalled_s

    async with client_session() as http:
        stopping = asyncio.create_task(stop_prefill())
        await asyncio.gather(*(client(http) for _ in range(CONCURRENCY)))
        exit_s = await stopping
        # The reference: a decode computing each prompt itself (no handoff).
        reference = {
            i: (
                await complete(http, decodes[0], greedy_body(model, prompts[i], MAX_TOKENS))
            ).token_ids
            for i in sorted(answers)
        }
    after = _counts(proxy, decodes)
    log = proc.log_path.read_bytes()[log_offset:].decode(errors="replace")
    return Episode(
        sent_before,
        answers,
        [i for i in answers if answers[i] != reference[i]],
        errors,
        {k: after[k] - before[k] for k in after},
        exit_s,
        log,
        stacks,
    )


def _assert_nothing_lost(ep: Episode, target: str) -> None:
    assert not ep.errors, ep.errors[:5]
    assert ep.sent_before >= CONCURRENCY and len(ep.answers) > ep.sent_before
    assert not ep.unequal, ep.unequal[:10]
    assert ep.counts["pulls"] > 0, "no request went by transfer before the signal"
    if target == "killed":
        return
    assert not ep.stacks, (
        f"the engine core had not begun to drain {DRAIN_START_S:.0f}s after the signal; "
        f"its processes' stacks then:\n{ep.stacks}"
    )
    # The drain ended by itself, not at --shutdown-timeout with what was left killed.
    assert "force killing" not in ep.log, "the prefill did not finish draining"
    if target == "process_group":  # the worker and the lease server outlived the group signal
        assert "keeps serving while the engine core drains" in ep.log
        assert "serving the held leases until the engine core stops" in ep.log
    assert ep.exit_s < SHUTDOWN_TIMEOUT_S + 30, f"the prefill took {ep.exit_s:.0f}s to exit"
    # Leases granted before the signal were served: no pull failed.
    assert ep.counts["pull_failures"] == 0, ep.counts


@pytest.mark.parametrize("target", ["api_server", "process_group", "killed"])
async def test_a_drained_prefill_loses_no_request(pair, target):
    if pair.prefill is None or not pair.prefill.process.alive:
        pair.start_prefill()
    pair.proxy.wait_for(
        "the prefill in rotation", lambda: pair.proxy.health()["status"] == "ok", 60
    )
    seed = {"api_server": 1, "process_group": 2, "killed": 3}[target]
    ep = await _stop_under_load(pair.model, pair.proxy, pair.prefill, [pair.decode], target, seed)
    print(ep.summary(f"1P1D, {target}"))
    _assert_nothing_lost(ep, target)
    # With its only prefill away, the decode computed the requests itself.
    assert ep.counts["local"] > 0, (
        "no request was computed by the decode while the prefill was away"
    )
    pair.prefill = None  # the next case starts it again


# -- two prefills, two decodes ----------------------------------------------------------------

TWO_HOSTS = {"p1": "127.0.0.32", "p2": "127.0.0.33", "d1": "127.0.0.34", "d2": "127.0.0.35"}
TWO_TE_PORT = 14320


class TwoPairs:
    def __init__(self, model: str, cfg: Path, log_dir: Path) -> None:
        self.model, self.cfg, self.log_dir = model, cfg, log_dir
        self.ports = {n: servers.free_port(h) for n, h in TWO_HOSTS.items()}
        self.servers: dict[str, servers.VllmServer] = {}
        self.proxy = None

    def start(self, name: str) -> servers.VllmServer:
        role = "kv_producer" if name.startswith("p") else "kv_consumer"
        own_url = "prefill_url" if role == "kv_producer" else "decode_url"
        args = kv_args(role, {own_url: f"{TWO_HOSTS[name]}:{TWO_TE_PORT}"})
        if role == "kv_producer":
            args += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        srv = servers.start_vllm(
            self.model, name=f"drain2-{name}", host=TWO_HOSTS[name], port=self.ports[name],
            args=args, env={"MOONCAKE_CONFIG_PATH": str(self.cfg)}, log_dir=self.log_dir,
            cli=True,
        )  # fmt: skip
        self.servers[name] = srv
        return srv

    def url(self, name: str) -> str:
        return f"http://{TWO_HOSTS[name]}:{self.ports[name]}"

    def all_in_rotation(self) -> bool:
        health = self.proxy.health()
        return health["status"] == "ok" and self.proxy.pool("prefill", True) == {
            self.url("p1"),
            self.url("p2"),
        }


@pytest.fixture(scope="module")
def two_pairs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drain2")
    cfg = mooncake_json(tmp / "mooncake.json")
    c = TwoPairs(tiny_model, cfg, tmp)
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(c.start, TWO_HOSTS))
        argv = [a for n in TWO_HOSTS for a in (f"--{'prefill' if n[0] == 'p' else 'decode'}",
                                               c.url(n))]  # fmt: skip
        c.proxy = start_proxy(argv)
        c.proxy.wait_for("all four in rotation", c.all_in_rotation, 60)
        yield c
    finally:
        with ThreadPoolExecutor(5) as pool:
            list(pool.map(lambda s: s.stop(), [s for s in (c.proxy, *c.servers.values()) if s]))


# Which prefill each case stops; the one stopped before is started again first, so each case
# has two prefills when it begins and one left to take the legs the stopped one no longer admits.
TWO_PAIR_CASES = [("api_server", "p1"), ("process_group", "p2"), ("killed", "p1")]


@pytest.mark.parametrize(("target", "victim"), TWO_PAIR_CASES)
async def test_2p2d_a_stopped_prefill_loses_no_request(two_pairs, target, victim):
    c = two_pairs
    for name in ("p1", "p2"):
        if not c.servers[name].process.alive:
            c.start(name)
    c.proxy.wait_for("both prefills in rotation", c.all_in_rotation, 60)
    decodes = [c.servers["d1"], c.servers["d2"]]
    seed = {"api_server": 11, "process_group": 12, "killed": 13}[target]
    ep = await _stop_under_load(c.model, c.proxy, c.servers[victim], decodes, target, seed)
    print(ep.summary(f"2P2D, {target} to {victim}"))
    _assert_nothing_lost(ep, target)
    # The other prefill was there: no request had to be computed by a decode.
    assert ep.counts["local"] == 0, ep.counts
