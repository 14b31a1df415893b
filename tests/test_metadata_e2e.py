"""Each metadata store end to end: a real store, prefill on 127.0.0.2 and decode on 127.0.0.3
configured from the example in configs/, outputs token-equal to a plain vLLM, prompts moved by
transfer; the engine registry; restarts of a peer and of the store.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from functools import partial
from pathlib import Path

import pytest

from harness import servers
from harness.pd import (
    DECODE_HOST,
    PREFILL_HOST,
    ServerSpec,
    complete,
    greedy_body,
    kv_args,
    start_many,
    two_legs,
)
from mooncake_vllm.core.registry import decode_record, registry_key
from mooncake_vllm.transfer.stores import open_store, parse_metadata_server

pytestmark = pytest.mark.servers

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MAX_TOKENS = 8
# The shared P2P pair uses the examples' ports on these hosts: this pair takes its own.
PREFILL_PORT, DECODE_PORT = 13203, 13212
METADATA_TTL_S = 6.0  # heartbeat every 2 s: a returning store is refilled quickly


class Pair:
    def __init__(self, kind: str, model: str, tmp_path: Path, log_on_failure):
        self.kind, self.model = kind, model
        self.store_server = {
            "etcd": servers.start_etcd,
            "redis": servers.start_redis,
            "http": servers.start_http_metadata,
        }[kind]()
        log_on_failure(self.store_server)
        # The user's example file, pointed at the store this test started.
        cfg = json.loads((CONFIGS / f"mooncake-tcp-{kind}.json").read_text())
        where = f"{self.store_server.host}:{self.store_server.port}"
        cfg["metadata_server"] = {
            "etcd": where,  # the seed's bare form, read with metadata_backend
            "redis": f"redis://{where}",
            "http": f"http://{where}/metadata",
        }[kind]
        cfg["prefill_url"] = f"{PREFILL_HOST}:{PREFILL_PORT}"
        cfg["decode_url"] = f"{DECODE_HOST}:{DECODE_PORT}"
        cfg["metadata_ttl_s"] = METADATA_TTL_S
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
        self.prefill, self.decode = start_many(model, list(self.specs.values()))
        for srv in (self.prefill, self.decode):
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

    async def store_get(self, key: str) -> bytes | None:
        store = open_store(self.target)
        try:
            return await store.get(key)
        finally:
            await store.close()

    def stop(self) -> None:
        for srv in (self.decode, self.prefill, self.store_server):
            srv.stop()


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
    for host, port in ((PREFILL_HOST, PREFILL_PORT), (DECODE_HOST, DECODE_PORT)):
        rpc_meta = json.loads(await pair.store_get(f"mooncake/rpc_meta/{host}:{port}"))
        assert rpc_meta["ip_or_host_name"] == host

    # The engine registry names the producer's side channel and segment under its engine id.
    record = decode_record(await pair.store_get(registry_key(pair.prefill_id, 0)))
    assert (record.role, record.side_channel) == (
        "kv_producer",
        f"{PREFILL_HOST}:{PREFILL_PORT + 1}",
    )
    assert record.te_segment == f"{PREFILL_HOST}:{PREFILL_PORT}"
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


async def test_etcd_seed_form_and_a_restarted_producer(pd, http, tmp_path, log_on_failure):
    pair = Pair("etcd", pd.model, tmp_path, log_on_failure)
    try:
        await _check_basics(pd, pair, http)
        # A handoff of the producer's previous life, to be used after its restart.
        old_prompt = _prompt(9)
        ask = {**_body(pd.model, old_prompt), "max_tokens": 1}
        ask["kv_transfer_params"] = {"do_remote_decode": True}
        head = await complete(http, pair.prefill, ask)
        # Crash the producer (its keys stay in etcd) and restart it on the same address.
        start_s = pair.restart("prefill")
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
        keys = [registry_key(pair.prefill_id, 0), f"mooncake/ram/{PREFILL_HOST}:{PREFILL_PORT}"]
        pair.prefill.stop()
        await _keys_gone(pair, keys)
        pair.stop()


async def test_redis_outage_and_a_restarted_consumer(pd, http, tmp_path, log_on_failure):
    pair = Pair("redis", pd.model, tmp_path, log_on_failure)
    try:
        await _check_basics(pd, pair, http)
        # The store goes away (and loses everything): peers that know each other keep going.
        port = pair.store_server.port
        pair.store_server.stop()
        assert await _handover(pd, pair, http, seed=20)
        # It comes back empty: every engine's keys are published again within a heartbeat.
        pair.store_server = servers.start_redis(port=port)
        log_on_failure(pair.store_server)
        deadline = time.monotonic() + 3 * METADATA_TTL_S
        for key in (  # each engine's bridge republishes on its own heartbeat
            registry_key(pair.prefill_id, 0),
            f"mooncake/ram/{PREFILL_HOST}:{PREFILL_PORT}",
            registry_key(pair.decode_id, 0),
            f"mooncake/ram/{DECODE_HOST}:{DECODE_PORT}",
        ):
            while await pair.store_get(key) is None:
                assert time.monotonic() < deadline, (
                    f"{key} not republished after the store returned"
                )
                await asyncio.sleep(0.25)
        # A consumer crashed and restarted under the same name pulls again.
        pair.restart("decode")
        usable_s = await _pulled_at_once(pd, pair, http, seed=30)
        print(f"consumer restart: the first pull took {usable_s:.1f}s")
    finally:
        pair.stop()


async def test_http_metadata_server(pd, http, tmp_path, log_on_failure):
    pair = Pair("http", pd.model, tmp_path, log_on_failure)
    try:
        await _check_basics(pd, pair, http)
    finally:
        keys = [registry_key(pair.decode_id, 0), f"mooncake/ram/{DECODE_HOST}:{DECODE_PORT}"]
        pair.decode.stop()
        await _keys_gone(pair, keys)
        pair.stop()


def test_unreachable_store_stops_vllm_at_startup(tiny_model, tmp_path):
    port = servers.free_port()
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"metadata_server": f"redis://127.0.0.1:{port}"}))
    with pytest.raises(servers.ServerStartError) as exc:
        servers.start_vllm(
            tiny_model,
            name="unreachable-store",
            args=kv_args("kv_consumer"),
            env={"MOONCAKE_CONFIG_PATH": str(config)},
            timeout_s=180,
        )
    message = str(exc.value)
    assert "exited" in message  # it stopped by itself, not at the harness's deadline
    assert f"metadata_server (redis redis://127.0.0.1:{port}) cannot be used" in message
    assert "P2PHANDSHAKE" in message
