"""Handoffs between engines of different layouts, on real servers: a TP2 engine ("wide", kv_both,
two worker processes) and one with 64-token blocks ("narrow") beside the shared cluster's TP1
engines with 128-token blocks.

- TP1 → TP2: the shared prefill hands over to wide; each wide rank reads only its two KV heads
  of every layer from the one producer rank (both share its lease).
- TP2 → TP1: wide hands over to the shared "both" engine (vLLM's default failure policy
  ``fail``), whose one rank reads two heads from each wide rank.
- TP2 → TP2 (the same layout): wide to itself (no prefix cache), rank to rank, whole blocks.
- Block sizes 128 → 64 and 64 → 128 ("narrow", kv_both, 64-token blocks), alone and with TP2 ↔
  TP1: vLLM's CPU attention keeps K column-major inside a block, so the consumer stages the
  needed heads' slabs of the producer's blocks and rearranges them into its own
  (``core.reblock``).

Each case is proven token for token against the shared plain vLLM, by vLLM's counter of prompt
tokens loaded by transfer (every prompt token), by our pull-failure counter (0) and by the bytes
pulled: the producer's blocks of the prompt × the model's KV bytes per block, each head read once.
A prompt that shares a prefix with one served before reads only the blocks after the consumer's
cached ones. A handoff of another block size in a format the decode does not rearrange is refused
before any byte moves.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import LOAD_TIMEOUT_S, NARROW_HOST, WIDE_HOST, prestarted
from test_connector_e2e import assert_failed_load

from harness import pd as harness
from harness.tiny_model import TinyModelSpec

pytestmark = pytest.mark.servers

SPEC = TinyModelSpec()  # the shared cluster's model: 4 layers, 4 KV heads of 64, float32
BLOCK, NARROW_BLOCK = 128, 64  # vLLM's CPU default, and narrow's
KV_BYTES_PER_TOKEN = SPEC.layers * SPEC.kv_heads * 2 * SPEC.head_dim * 4
KV_BYTES_PER_BLOCK = BLOCK * KV_BYTES_PER_TOKEN
MAX_TOKENS = 8
LENGTHS = [1, 63, 127, 128, 129, 300, 700]


def _engine_args(host: str, port: int, *extra: str) -> list[str]:
    trusted = ["127.0.0.2", "127.0.0.4", WIDE_HOST, NARROW_HOST]
    extra_config = {
        "prefill_url": f"{host}:{port}",
        "load_timeout_s": LOAD_TIMEOUT_S,
        "trusted_producers": trusted,
    }
    # Handoffs to itself would otherwise come from its own prefix cache.
    return [*extra, "--no-enable-prefix-caching", *harness.kv_args("kv_both", extra_config)]


@pytest.fixture(scope="module")
def engines(cluster, tmp_path_factory):
    started = prestarted(__name__, lambda: prestart(cluster, tmp_path_factory.mktemp("layout")))
    yield started
    for server in started:
        server.stop()


def prestart(cluster, tmp: Path) -> list:
    """wide: TP2 (two worker processes); narrow: 64-token blocks. Both producer and consumer,
    vLLM's default failure policy, no prefix caching. (Begun by the API matrix's module, which
    runs before this one: see conftest.)"""
    env = {"MOONCAKE_CONFIG_PATH": str(cluster.config_path)}
    tp2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    narrow = ["--block-size", str(NARROW_BLOCK)]
    specs = [
        harness.ServerSpec("wide-tp2", WIDE_HOST, _engine_args(WIDE_HOST, 13040, *tp2), env),
        harness.ServerSpec(
            "narrow-b64", NARROW_HOST, _engine_args(NARROW_HOST, 13050, *narrow), env
        ),
    ]
    return harness.start_many(cluster.model, specs)


@pytest.fixture
def wide(engines):
    return engines[0]


@pytest.fixture
def narrow(engines):
    return engines[1]


def _prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SPEC.vocab) for _ in range(n)] for n in lengths]


def _body(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}


async def _handover(pd, producer, consumer, prompts, tp: int) -> tuple[dict[str, float], float]:
    """Each prompt through ``producer`` → ``consumer`` (of ``tp`` ranks), token-exact against
    plain; returns the consumer's pull counters and the prompt tokens it counted as transferred,
    as deltas. Every consumer rank counts its own pull."""
    before, by_transfer = harness.PULL_COUNTERS.read(consumer), harness.tokens_by_transfer(consumer)
    async with harness.client_session() as http:
        for prompt in prompts:
            body = _body(pd.model, prompt)
            plain = await harness.complete(http, pd.plain, body)
            _, tail = await harness.two_legs(http, producer, consumer, body)
            assert tail.token_ids == plain.token_ids, f"{len(prompt)}-token prompt differs"
    moved = await harness.pulls_since(consumer, before, len(prompts) * tp)
    return moved, harness.tokens_by_transfer(consumer) - by_transfer


def _check(
    moved: dict[str, float], by_transfer: float, prompts, tp: int, producer_block: int = BLOCK
) -> None:
    assert moved["pull_failures"] == 0
    assert moved["pulls"] == len(prompts) * tp
    # Every prompt token (vLLM may compute a prompt's last token itself).
    tokens = sum(len(p) for p in prompts)
    assert tokens - len(prompts) <= by_transfer <= tokens
    # Each head of each of the producer's blocks once, whatever the TP and block sizes.
    blocks = sum(-(-len(p) // producer_block) for p in prompts)
    assert moved["bytes"] == blocks * producer_block * KV_BYTES_PER_TOKEN


async def test_tp1_to_tp2(pd, wide):
    prompts = _prompts(1)
    _check(*await _handover(pd, pd.prefill, wide, prompts, 2), prompts, 2)


async def test_tp2_to_tp1_under_the_fail_policy(pd, wide):
    prompts = _prompts(2)
    _check(*await _handover(pd, wide, pd.both, prompts, 1), prompts, 1)


async def test_tp2_to_tp2(pd, wide):
    prompts = _prompts(3)
    _check(*await _handover(pd, wide, wide, prompts, 2), prompts, 2)


async def test_blocks_of_128_to_64(pd, narrow):
    prompts = _prompts(6)
    _check(*await _handover(pd, pd.prefill, narrow, prompts, 1), prompts, 1)


async def test_blocks_of_64_to_128_under_the_fail_policy(pd, narrow):
    prompts = _prompts(7)
    _check(*await _handover(pd, narrow, pd.both, prompts, 1), prompts, 1, NARROW_BLOCK)


async def test_tp2_with_blocks_of_128_to_tp1_with_64(pd, wide, narrow):
    prompts = _prompts(8)
    _check(*await _handover(pd, wide, narrow, prompts, 1), prompts, 1)


async def test_tp1_with_blocks_of_64_to_tp2_with_128(pd, wide, narrow):
    prompts = _prompts(9)
    _check(*await _handover(pd, narrow, wide, prompts, 2), prompts, 2, NARROW_BLOCK)


async def test_a_partial_prefix_hit_on_the_consumer_reads_only_the_rest(pd, wide):
    """A prompt sharing 200 tokens with one "both" served before: "both" caches its first block
    (128 tokens), so the TP2 → TP1 pull reads the prompt's two other blocks only."""
    (first,) = _prompts(4, [250])
    second = first[:200] + _prompts(5, [100])[0]
    await _handover(pd, wide, pd.both, [first], 1)
    before, by_transfer = harness.PULL_COUNTERS.read(pd.both), harness.tokens_by_transfer(pd.both)
    async with harness.client_session() as http:
        body = _body(pd.model, second)
        plain = await harness.complete(http, pd.plain, body)
        _, tail = await harness.two_legs(http, wide, pd.both, body)
    assert tail.token_ids == plain.token_ids
    moved = await harness.pulls_since(pd.both, before, 1)
    assert (moved["pulls"], moved["pull_failures"]) == (1, 0)
    assert harness.tokens_by_transfer(pd.both) - by_transfer == len(second) - BLOCK
    assert moved["bytes"] == 2 * KV_BYTES_PER_BLOCK


@pytest.mark.provokes_pull_failure
async def test_a_block_size_in_a_format_the_decode_cannot_rearrange_is_refused(pd, narrow):
    """narrow's handoff (64-token blocks) with its KV format changed to one the decode does not
    re-block: "both" (128-token blocks, policy ``fail``) refuses it before any byte moves, names
    both block sizes and formats in its log, answers vLLM's load-failure error, and narrow's lease
    is released at once (not left to its TTL)."""
    (prompt,) = _prompts(10, [300])
    body = _body(pd.model, prompt)
    before = harness.PULL_COUNTERS.read(pd.both)
    async with harness.client_session() as http:
        head = await harness.complete(
            http,
            narrow,
            {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        params = {**head.kv_transfer_params, "kv_format": "cpu-amx"}
        async with http.post(
            f"{pd.both.url}/v1/completions", json={**body, "kv_transfer_params": params}
        ) as resp:
            status, text = resp.status, await resp.text()
    assert_failed_load(status, text)
    moved = await harness.pulls_since(pd.both, before, 1)
    assert (moved["pulls"], moved["pull_failures"], moved["bytes"]) == (0, 1, 0)
    log = pd.both.process.log_path.read_text(errors="replace")
    assert (
        "block size 64 at the producer, 128 here, and KV format 'cpu-amx' at the producer, this "
        "consumer re-blocks 'cpu-vec' only"
    ) in log
    await harness.eventually(lambda: narrow.metric("mooncake_vllm:held_leases") == 0, 5)
