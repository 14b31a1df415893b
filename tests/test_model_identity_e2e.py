"""KV from another model of the same shape is refused: the shared cluster's prefill serving the
tiny Llama and a decode serving the same architecture with other weights (another seed) under the
Llama's served name, with vLLM's default ``kv_load_failure_policy`` (``fail``). Without the model
in the compat hash the decode would read the prefill's blocks and answer fluently and wrongly;
with it, the client gets an error, and the decode's log names both models' identities.

A decode of another head size and dtype (32 instead of 64, bfloat16 instead of float32) is
refused the same way, its log naming both sides' values.
"""

from __future__ import annotations

import contextlib
import random
import re

import pytest

from harness import servers
from harness.pd import (
    ServerSpec,
    client_session,
    eventually,
    greedy_body,
    kv_args,
    start_many,
    two_legs,
)
from harness.tiny_model import TinyModelSpec, build_tiny_model
from mooncake_vllm.core.model_identity import model_identity, short_identity

pytestmark = [pytest.mark.servers, pytest.mark.long]  # two starts of its own: make test-long

DECODE_HOST, OTHER_HOST = "127.0.0.52", "127.0.0.53"
MODEL_A, MODEL_B = TinyModelSpec(), TinyModelSpec(seed=5678)  # same shape, other weights
MODEL_C = TinyModelSpec(hidden=128, head_dim=32, intermediate=256, seed=91)  # another head size


@pytest.fixture(scope="module")
def mismatched_pair(cluster):
    """Model A is the shared cluster's (its prefill hands over); the decode serves model B, the
    other decode model C in bfloat16, both under model A's name so that they accept its
    requests. Yields the three engines and the identities of A and B."""
    model_a, model_b = cluster.model, build_tiny_model(spec=MODEL_B)
    assert str(build_tiny_model(spec=MODEL_A)) == model_a
    model_c = build_tiny_model(spec=MODEL_C)
    # The cluster's config: its shared secret, so that the refusing decodes' releases of the
    # prefill's leases are authenticated (the leases end at once, not at their TTL).
    env = {"MOONCAKE_CONFIG_PATH": str(cluster.config_path)}
    name = ("--served-model-name", model_a)

    def consumer(host: str) -> tuple[str, ...]:
        return (*kv_args("kv_consumer", {"decode_url": f"{host}:13012"}), *name)

    specs = [
        ServerSpec("decode-b", DECODE_HOST, consumer(DECODE_HOST), env, str(model_b)),
        ServerSpec(
            "decode-c-bf16", OTHER_HOST, (*consumer(OTHER_HOST), "--dtype", "bfloat16"), env,
            str(model_c),
        ),
    ]  # fmt: skip
    started = start_many(model_a, specs)
    with contextlib.ExitStack() as stack:
        for srv in started:
            stack.enter_context(servers.running(srv))
        identities = [short_identity(model_identity(str(m))) for m in (model_a, model_b)]
        yield (cluster.prefill, *started, *identities)


async def test_kv_of_another_model_of_the_same_shape_is_refused_not_used(
    mismatched_pair, log_on_failure
):
    prefill, decode, _, ident_a, ident_b = mismatched_pair
    for srv in (prefill, decode):
        log_on_failure(srv)
    assert ident_a != ident_b
    ext0 = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    failures0 = decode.metric("mooncake_vllm:pull_failures_total")
    rng = random.Random(24)
    async with client_session() as http:
        for stream in (False, True):
            prompt = [rng.randrange(3, 2048) for _ in range(300)]
            body = greedy_body(prefill.model, prompt, 8, stream=stream)
            with pytest.raises(RuntimeError) as refused:
                await two_legs(http, prefill, decode, body)
            print(f"stream={stream}: the client saw {str(refused.value)[:200]}")

    # The decode says why, naming both sides' model identities.
    log = decode.process.log_path.read_text(errors="replace")
    assert re.search(
        rf"handoff rejected: compat hash mismatch.*producer: .*model {ident_a}, "
        rf"this consumer: .*model {ident_b}",
        log,
    ), "the refusal should name both models"
    for srv, ident in ((prefill, ident_a), (decode, ident_b)):
        said = f"model identity {ident} (fingerprint of the model's files"
        assert said in srv.process.log_path.read_text(errors="replace"), srv.process.name
    # Counted as failed pulls; not one prompt token arrived by transfer.
    await eventually(
        lambda: decode.metric("mooncake_vllm:pull_failures_total") == failures0 + 2, 20
    )
    ext = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert ext == ext0
    # The refused handoffs' leases are released at once (not left to their TTL).
    await eventually(lambda: prefill.metric("mooncake_vllm:held_leases") == 0, 5)


async def test_kv_of_another_head_size_and_dtype_is_refused_naming_both(
    mismatched_pair, log_on_failure
):
    """Model A's float32 KV with 64-wide heads, offered to a decode of 32-wide heads in
    bfloat16: refused before a byte moves, through vLLM's failure policy, the decode's log
    naming both sides' head sizes and dtypes; the lease is released at once."""
    prefill, _, other, _, _ = mismatched_pair
    for srv in (prefill, other):
        log_on_failure(srv)
    ext0 = other.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    failures0 = other.metric("mooncake_vllm:pull_failures_total")
    prompt = [random.Random(25).randrange(3, 2048) for _ in range(300)]
    async with client_session() as http:
        with pytest.raises(RuntimeError):
            await two_legs(http, prefill, other, greedy_body(prefill.model, prompt, 8))
    log = other.process.log_path.read_text(errors="replace")
    refusal = re.search(r"handoff rejected: compat hash mismatch.*", log)
    assert refusal, "the decode should say why it refused"
    said = refusal.group(0)
    for value in ("4 heads x 64", "4 heads x 32", "torch.float32", "torch.bfloat16"):
        assert value in said, (value, said)
    assert said.index("4 heads x 64") < said.index("this consumer") < said.index("4 heads x 32")
    await eventually(lambda: other.metric("mooncake_vllm:pull_failures_total") == failures0 + 1, 20)
    assert other.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == ext0
    await eventually(lambda: prefill.metric("mooncake_vllm:held_leases") == 0, 5)
