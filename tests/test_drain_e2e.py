"""A prefill told to stop under load, as users stop it: nothing a client sent is lost.

The README's pair (one ``mooncake.json``, P2P handshake over TCP, vLLM's default
``kv_load_failure_policy`` ``fail``) behind ``proxy/proxy_server.py``, the prefill started with
vLLM's ``--shutdown-timeout 30`` as ``vllm serve``. Requests run at concurrency 8; a few seconds
in, the prefill gets SIGTERM, either at its API server alone (``docker stop``, Kubernetes) or at
its whole process group (systemd's ``KillMode=control-group``, a terminal's Ctrl-C). Load goes on
until the prefill has exited. Every request, sent before the signal or after, must answer 200
with the tokens the decode computes for the prompt on its own (a plain request: no handoff),
which ``test_new_user_setup`` shows equal to a plain vLLM's. With one prefill, the requests it
no longer admits are computed by the decode (``mooncake_proxy_dispatched_total{how="local"}``).
The prefill is started again on its address for the next case, and the proxy takes it back.

Three vLLM starts (decode, prefill, prefill again): past the suite's budget for one module, so
it runs only with ``MOONCAKE_VLLM_DRAIN_E2E=1`` (``make test-drain``).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import pytest

from harness import servers
from harness.pd import client_session, complete, greedy_body, kv_args, mooncake_json
from harness.xpyd import start_pair_proxy

pytestmark = [
    pytest.mark.servers,
    pytest.mark.skipif(
        os.environ.get("MOONCAKE_VLLM_DRAIN_E2E") != "1",
        reason="three vLLM starts: run with MOONCAKE_VLLM_DRAIN_E2E=1 (make test-drain)",
    ),
]

HOST = "127.0.0.31"
SHUTDOWN_TIMEOUT_S = 30
CONCURRENCY = 8
MAX_TOKENS = 8
LOAD_BEFORE_SIGNAL_S = 4.0


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


@pytest.mark.parametrize("target", ["api_server", "process_group"])
async def test_a_drained_prefill_loses_no_request(pair, target):
    if pair.prefill is None or not pair.prefill.process.alive:
        pair.start_prefill()
    pair.proxy.wait_for(
        "the prefill in rotation", lambda: pair.proxy.health()["status"] == "ok", 60
    )
    prompts = _prompts(seed={"api_server": 1, "process_group": 2}[target], count=400)
    local0 = pair.proxy.metric("mooncake_proxy_dispatched_total", how="local")
    reloaded0 = pair.proxy.metric("mooncake_proxy_dispatched_total", how="reloaded")
    failures0 = pair.decode.metric("mooncake_vllm:pull_failures_total")
    pulls0 = pair.decode.metric("mooncake_vllm:pulls_total")
    signalled_s: float | None = None
    exited = asyncio.Event()
    answers: dict[int, list[int]] = {}
    errors: list[str] = []
    sent_before = 0
    queue = iter(range(len(prompts)))

    async def client(http) -> None:
        nonlocal sent_before
        for i in queue:
            if exited.is_set():
                return
            if signalled_s is None:
                sent_before += 1
            body = greedy_body(pair.model, prompts[i], MAX_TOKENS, stream=i % 2 == 1)
            try:
                answers[i] = (await complete(http, pair.proxy.url, body)).token_ids
            except Exception as e:  # each one is reported below
                errors.append(f"request {i}: {e}")

    async def stop_prefill() -> None:
        nonlocal signalled_s
        await asyncio.sleep(LOAD_BEFORE_SIGNAL_S)
        proc = pair.prefill.process
        signalled_s = time.monotonic()
        if target == "api_server":
            os.kill(proc.proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.proc.pid, signal.SIGTERM)
        while proc.alive or proc.group_pids():
            await asyncio.sleep(0.2)
        exited.set()

    async with client_session() as http:
        stopping = asyncio.create_task(stop_prefill())
        await asyncio.gather(*(client(http) for _ in range(CONCURRENCY)))
        await stopping
        exit_s = time.monotonic() - signalled_s
        exit_code = pair.prefill.process.proc.returncode
        # The reference: the decode computing each prompt itself (no handoff).
        reference = {
            i: (
                await complete(http, pair.decode, greedy_body(pair.model, prompts[i], MAX_TOKENS))
            ).token_ids
            for i in sorted(answers)
        }
    unequal = [i for i in answers if answers[i] != reference[i]]
    local = pair.proxy.metric("mooncake_proxy_dispatched_total", how="local") - local0
    reloaded = pair.proxy.metric("mooncake_proxy_dispatched_total", how="reloaded") - reloaded0
    pulls = pair.decode.metric("mooncake_vllm:pulls_total") - pulls0
    failures = pair.decode.metric("mooncake_vllm:pull_failures_total") - failures0
    log = pair.prefill.process.log_tail(400_000)
    print(
        f"{target}: {sent_before} sent before the signal, {len(answers) + len(errors)} in all, "
        f"{len(answers)} answered, {len(unequal)} unequal, {len(errors)} failed; "
        f"local {local:.0f}, reloaded {reloaded:.0f}, pulls {pulls:.0f}, pull failures "
        f"{failures:.0f}; prefill exited {exit_s:.1f}s after the signal, code {exit_code}"
    )
    assert not errors, errors[:5]
    assert sent_before >= CONCURRENCY and len(answers) > sent_before
    assert not unequal, unequal[:10]
    assert pulls > 0, "no request went by transfer before the signal"
    assert local > 0, "no request was computed by the decode while the prefill was away"
    # The drain ended by itself, not at --shutdown-timeout with what was left killed.
    assert "force killing" not in log, "the prefill did not finish draining"
    if target == "process_group":  # the worker and the lease server outlived the group signal
        assert "keeps serving while the engine core drains" in log
        assert "serving the held leases until the engine core stops" in log
    assert exit_s < SHUTDOWN_TIMEOUT_S + 30, f"the prefill took {exit_s:.0f}s to exit"
    pair.prefill = None  # the next case starts it again
