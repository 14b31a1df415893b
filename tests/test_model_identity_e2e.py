"""KV from another model of the same shape is refused: a prefill serving the tiny Llama and a
decode serving the same architecture with other weights (another seed), both under one served
model name, with vLLM's default ``kv_load_failure_policy`` (``fail``). Without the model in the
compat hash the decode would read the prefill's blocks and answer fluently and wrongly; with it,
the client gets an error, and the decode's log names both models' identities.
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
    mooncake_json,
    start_many,
    two_legs,
)
from harness.tiny_model import TinyModelSpec, build_tiny_model
from mooncake_vllm.core.model_identity import model_identity, short_identity

pytestmark = pytest.mark.servers

PREFILL_HOST, DECODE_HOST = "127.0.0.51", "127.0.0.52"
SERVED_NAME = "tiny-llama"  # one name for both models, so each server accepts the requests
MODEL_A, MODEL_B = TinyModelSpec(), TinyModelSpec(seed=5678)  # same shape, other weights


@pytest.fixture(scope="module")
def mismatched_pair(tmp_path_factory):
    """The prefill serves model A, the decode model B; yields them and the two identities."""
    model_a, model_b = build_tiny_model(spec=MODEL_A), build_tiny_model(spec=MODEL_B)
    cfg = mooncake_json(
        tmp_path_factory.mktemp("model-identity") / "mooncake.json",
        prefill_url=f"{PREFILL_HOST}:13003",
        decode_url=f"{DECODE_HOST}:13012",
    )
    env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
    name = ("--served-model-name", SERVED_NAME)
    specs = [
        ServerSpec("prefill-a", PREFILL_HOST, (*kv_args("kv_producer"), *name), env, str(model_a)),
        ServerSpec("decode-b", DECODE_HOST, (*kv_args("kv_consumer"), *name), env, str(model_b)),
    ]
    started = start_many(str(model_a), specs)
    with contextlib.ExitStack() as stack:
        for srv in started:
            stack.enter_context(servers.running(srv))
        identities = [short_identity(model_identity(str(m))) for m in (model_a, model_b)]
        yield (*started, *identities)


async def test_kv_of_another_model_of_the_same_shape_is_refused_not_used(
    mismatched_pair, log_on_failure
):
    prefill, decode, ident_a, ident_b = mismatched_pair
    for srv in (prefill, decode):
        log_on_failure(srv)
    assert ident_a != ident_b
    ext0 = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    failures0 = decode.metric("mooncake_vllm:pull_failures_total")
    rng = random.Random(24)
    async with client_session() as http:
        for stream in (False, True):
            prompt = [rng.randrange(3, 2048) for _ in range(300)]
            body = greedy_body(SERVED_NAME, prompt, 8, stream=stream)
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
    await eventually(lambda: prefill.metric("mooncake_vllm:held_leases") == 0, 10)
