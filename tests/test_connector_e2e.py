"""MooncakeConnector end to end: real prefill and decode vLLM servers, the real transfer engine
over TCP with P2P-handshake metadata, compared token for token with a plain vLLM.

The client here does both legs itself (the proxy has its own tests).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import uuid
from functools import partial

import pytest

from harness.pd import (
    complete,
    greedy_body,
    two_legs,
)
from harness.servers import metric_samples

pytestmark = pytest.mark.servers

BLOCK = 128  # vLLM's CPU block size
MAX_TOKENS = 12
# Around every block boundary, from one token to ~1500.
LENGTHS = [1, 2, 7, 31, 64, 127, 128, 129, 200, 255, 256, 257, 300, 383, 384, 385, 450, 511, 512,
           513, 640, 767, 768, 769, 900, 1000, 1023, 1024, 1025, 1200, 1400, 1500]  # fmt: skip


def prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    """Random token-id prompts; a distinct seed per test keeps decode's prefix cache cold."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


def blocks(n: int) -> int:
    return -(-n // BLOCK)


body = partial(greedy_body, max_tokens=MAX_TOKENS)


def prefill_body(model: str, prompt) -> dict:
    """A prefill leg sent by hand: one token, handoff requested."""
    params = {"do_remote_decode": True, "transfer_id": str(uuid.uuid4())}
    return body(model, prompt, max_tokens=1, kv_transfer_params=params)


async def eventually(check, timeout_s: float = 15.0, interval_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            assert check()
        await asyncio.sleep(interval_s)


# vLLM 0.32's answer to a request whose KV load failed under kv_load_failure_policy "fail": the
# scheduler ends it FINISHED_ERROR, the OpenAI server raises GenerationError for finish reason
# "error" (vllm/entrypoints/generate/base/serving.py, ``_raise_if_error``) and answers this
# document with HTTP 500; a stream has already answered 200, so it gets the document as its one
# event before [DONE].
FAILED_LOAD_ERROR = {
    "error": {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def assert_failed_load(status: int, text: str, stream: bool = False) -> None:
    """``status`` and ``text`` are vLLM's answer to a request whose KV load failed (policy
    "fail"): the error document, with 500 or as the stream's only event."""
    if not stream:
        assert status == 500, text
        assert json.loads(text) == FAILED_LOAD_ERROR, text
        return
    assert status == 200, text
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.strip()]
    assert events[-1:] == ["[DONE]"], text
    assert [json.loads(e) for e in events[:-1]] == [FAILED_LOAD_ERROR], text


def nothing_held(srv) -> bool:
    return srv.metric("mooncake_vllm:held_leases") == 0 and srv.metric(
        "vllm:kv_cache_usage_perc"
    ) == pytest.approx(0.0, abs=1e-9)


def test_vllms_spin_is_shortened_everywhere_and_the_gil_switch_interval_in_workers(pd):
    """``vllm_busy_loop_s`` reaches the worker and the engine core, ``gil_switch_interval_s`` the
    worker only (the engine core's threads keep Python's interval)."""
    spin, gil = "spin 0.020 s after a message", "GIL switch interval in this process: 0.20 ms"
    for srv in (pd.prefill, pd.decode):
        log = srv.process.log_path.read_text(errors="replace")
        for proc, said in (("Worker", spin), ("EngineCore", spin), ("Worker", gil)):
            assert re.search(rf"\({proc}[^)]*\).*{re.escape(said)}", log), (srv.url, proc, said)
        assert not re.search(rf"\(EngineCore[^)]*\).*{re.escape(gil)}", log), srv.url


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_outputs_equal_plain_and_prompts_arrive_by_transfer(pd, http, stream):
    batch = prompts(seed=100 + stream)
    ext0 = pd.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    pulls0, blocks0 = (
        pd.decode.metric("mooncake_vllm:pulls_total"),
        pd.decode.metric("mooncake_vllm:blocks_total"),
    )
    bytes0 = pd.decode.metric("mooncake_vllm:bytes_total")
    failures0 = pd.decode.metric("mooncake_vllm:pull_failures_total")
    mismatches = []
    for prompt in batch:
        ref = await complete(http, pd.plain, body(pd.model, prompt))
        head, tail = await two_legs(
            http, pd.prefill, pd.decode, body(pd.model, prompt, stream=stream)
        )
        assert head.kv_transfer_params["remote_block_ids"], head.kv_transfer_params
        assert len(tail.token_ids) == MAX_TOKENS
        if tail.token_ids != ref.token_ids:
            mismatches.append((len(prompt), ref.token_ids, tail.token_ids))
    assert not mismatches, f"decode differs from plain for (len, plain, decode): {mismatches}"

    # Decode's own counters: every prompt token but the last (which vLLM always computes) came
    # from the external transfer, and each handoff was one pull of all the prompt's blocks.
    expected = sum(len(p) for p in batch)
    await eventually(lambda: pd.decode.metric("mooncake_vllm:pulls_total") - pulls0 == len(batch))
    ext = pd.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert expected - len(batch) <= ext - ext0 <= expected
    assert pd.decode.metric("mooncake_vllm:blocks_total") - blocks0 == sum(
        blocks(len(p)) for p in batch
    )
    assert pd.decode.metric("mooncake_vllm:bytes_total") > bytes0
    assert pd.decode.metric("mooncake_vllm:pull_failures_total") == failures0
    await eventually(lambda: nothing_held(pd.prefill))
    for srv in (pd.prefill, pd.decode):  # vLLM's connector naming, and the alias alike
        assert series_by_prefix(srv, "vllm:mooncake_") == series_by_prefix(srv, "mooncake_vllm:")


def series_by_prefix(srv, prefix: str) -> dict[str, float]:
    """Our samples on ``srv``'s ``/metrics`` under ``prefix``, keyed without it (``_created``
    timestamps left out: the two names are created a moment apart)."""
    return {
        f"{s.name.removeprefix(prefix)}{sorted(s.labels.items())}": s.value
        for s in metric_samples(srv.url + "/metrics")
        if s.name.startswith(prefix) and not s.name.endswith("_created")
    }


async def test_prefill_ending_on_a_stop_token_still_hands_over(pd, http):
    prompt = prompts(seed=7, lengths=[300])[0]
    ref = await complete(http, pd.plain, body(pd.model, prompt))
    pulls0 = pd.decode.metric("mooncake_vllm:pulls_total")
    # The one token prefill produces is made a stop token: the request ends FINISHED_STOPPED.
    head, tail = await two_legs(
        http, pd.prefill, pd.decode, body(pd.model, prompt),
        prefill_extra={"stop_token_ids": [ref.token_ids[0]]},
    )  # fmt: skip
    assert head.finish_reason == "stop"
    assert head.kv_transfer_params["remote_block_ids"]
    assert tail.token_ids == ref.token_ids
    await eventually(lambda: pd.decode.metric("mooncake_vllm:pulls_total") == pulls0 + 1)


async def test_warm_prefix_cache_pulls_only_missing_blocks(pd, http):
    rng = random.Random(11)
    shared = [rng.randrange(3, 2048) for _ in range(3 * BLOCK)]
    first = shared + [rng.randrange(3, 2048) for _ in range(2 * BLOCK + 10)]
    second = shared + [rng.randrange(3, 2048) for _ in range(BLOCK + 50)]
    await two_legs(http, pd.prefill, pd.decode, body(pd.model, first))
    await eventually(lambda: nothing_held(pd.prefill))

    blocks0 = pd.decode.metric("mooncake_vllm:blocks_total")
    hits0 = pd.decode.metric("vllm:prefix_cache_hits_total")
    ref = await complete(http, pd.plain, body(pd.model, second))
    _, tail = await two_legs(http, pd.prefill, pd.decode, body(pd.model, second))
    assert tail.token_ids == ref.token_ids
    await eventually(
        lambda: pd.decode.metric("mooncake_vllm:blocks_total") - blocks0 == blocks(len(second)) - 3
    )
    assert pd.decode.metric("vllm:prefix_cache_hits_total") - hits0 == 3 * BLOCK
    await eventually(lambda: nothing_held(pd.prefill))


async def test_request_without_params_is_computed_locally_on_decode(pd, http):
    prompt = prompts(seed=13, lengths=[200])[0]
    pulls0 = pd.decode.metric("mooncake_vllm:pulls_total")
    ref = await complete(http, pd.plain, body(pd.model, prompt))
    got = await complete(http, pd.decode, body(pd.model, prompt))
    assert got.token_ids == ref.token_ids
    assert pd.decode.metric("mooncake_vllm:pulls_total") == pulls0


@pytest.mark.parametrize(
    ("mangle", "decode_ends_the_lease"),
    [
        pytest.param(
            lambda p: {**p, "transfer_id": f"unknown-{uuid.uuid4()}"}, False, id="unknown-id"
        ),
        pytest.param(lambda p: {**p, "compat_hash": "0" * 64}, True, id="wrong-compat-hash"),
        pytest.param(
            lambda p: {**p, "remote_block_ids": p["remote_block_ids"][:1]}, True, id="short"
        ),
        pytest.param(lambda p: {"do_remote_prefill": True, "transfer_id": 5}, False, id="garbage"),
    ],
)
@pytest.mark.provokes_pull_failure
async def test_bad_handoff_recomputes_within_the_deadline(pd, http, mangle, decode_ends_the_lease):
    prompt = prompts(seed=17, lengths=[400])[0]
    ref = await complete(http, pd.plain, body(pd.model, prompt))
    head = await complete(http, pd.prefill, prefill_body(pd.model, prompt))
    failures0 = pd.decode.metric("mooncake_vllm:pull_failures_total")
    t0 = time.monotonic()
    got = await complete(
        http, pd.decode, body(pd.model, prompt, kv_transfer_params=mangle(head.kv_transfer_params))
    )
    assert time.monotonic() - t0 < pd.load_timeout_s + 5
    assert got.token_ids == ref.token_ids  # recomputed locally (kv_load_failure_policy=recompute)
    await eventually(lambda: pd.decode.metric("mooncake_vllm:pull_failures_total") == failures0 + 1)
    if not decode_ends_the_lease:
        # An unknown id names no lease and garbage names nothing: the lease stays for the
        # genuine handoff, which still pulls (the decode now has the prompt's full blocks
        # cached, so it reads at least the last one), and that pull ends it.
        pulls0 = pd.decode.metric("mooncake_vllm:pulls_total")
        got = await complete(
            http, pd.decode, body(pd.model, prompt, kv_transfer_params=head.kv_transfer_params)
        )
        assert got.token_ids == ref.token_ids
        await eventually(lambda: pd.decode.metric("mooncake_vllm:pulls_total") == pulls0 + 1)
        assert pd.decode.metric("mooncake_vllm:pull_failures_total") == failures0 + 1
        await eventually(lambda: nothing_held(pd.prefill), timeout_s=5)
    # A handoff naming the lease (a wrong compat hash, a short block list) is given back by the
    # rejecting decode (acquire, then release), or else the lease expires.
    await eventually(lambda: nothing_held(pd.prefill), timeout_s=pd.lease_ttl_s + 10)


@pytest.mark.provokes_pull_failure
async def test_unpulled_lease_expires_and_a_late_pull_is_refused(pd, http):
    prompt = prompts(seed=19, lengths=[333])[0]
    ref = await complete(http, pd.plain, body(pd.model, prompt))
    expired0 = pd.prefill.metric("mooncake_vllm:expired_total")
    head = await complete(http, pd.prefill, prefill_body(pd.model, prompt))
    await eventually(lambda: pd.prefill.metric("mooncake_vllm:held_leases") == 1, timeout_s=5)
    await eventually(lambda: nothing_held(pd.prefill), timeout_s=pd.lease_ttl_s + 10)
    assert pd.prefill.metric("mooncake_vllm:expired_total") == expired0 + 1

    refused0 = pd.decode.metric("mooncake_vllm:refused_total")
    got = await complete(
        http, pd.decode, body(pd.model, prompt, kv_transfer_params=head.kv_transfer_params)
    )
    assert got.token_ids == ref.token_ids
    # The consumer counts the producer's refusal; its pull failed and it recomputed.
    await eventually(lambda: pd.decode.metric("mooncake_vllm:refused_total") == refused0 + 1)


@pytest.mark.provokes_pull_failure
async def test_aborted_requests_free_their_blocks_on_both_sides(pd, http):
    prompt = prompts(seed=23, lengths=[1500])[0]
    # Prefill aborted by the client while computing: nothing is held.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(complete(http, pd.prefill, prefill_body(pd.model, prompt)), 0.05)
    await eventually(lambda: nothing_held(pd.prefill))

    # Decode aborted while its load may be in flight: the lease is still released.
    head = await complete(http, pd.prefill, prefill_body(pd.model, prompt))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(
            complete(
                http, pd.decode,
                body(pd.model, prompt, max_tokens=200, stream=True,
                     kv_transfer_params=head.kv_transfer_params),
            ),
            timeout=0.05,
        )  # fmt: skip
    await eventually(lambda: nothing_held(pd.prefill))
    await eventually(lambda: nothing_held(pd.decode))


# ---- kv_both, and the fail policy ---------------------------------------------------------------


@pytest.fixture
def both(pd):
    """The cluster's kv_both instance ("host" 127.0.0.4), with kv_load_failure_policy=fail."""
    return pd.both


async def test_kv_both_instance_consumes_and_produces(pd, both, http):
    a, b = prompts(seed=29, lengths=[260, 700])
    ref_a = await complete(http, pd.plain, body(pd.model, a))
    both_pulls0 = both.metric("mooncake_vllm:pulls_total")
    _, tail = await two_legs(http, pd.prefill, both, body(pd.model, a))  # both as consumer
    assert tail.token_ids == ref_a.token_ids
    await eventually(lambda: both.metric("mooncake_vllm:pulls_total") == both_pulls0 + 1)
    ref_b = await complete(http, pd.plain, body(pd.model, b))
    pulls0 = pd.decode.metric("mooncake_vllm:pulls_total")
    _, tail = await two_legs(http, both, pd.decode, body(pd.model, b))  # both as producer
    assert tail.token_ids == ref_b.token_ids
    await eventually(lambda: pd.decode.metric("mooncake_vllm:pulls_total") == pulls0 + 1)
    assert both.metric("mooncake_vllm:pulls_total") == both_pulls0 + 1  # it pulled nothing more
    await eventually(lambda: nothing_held(both))


@pytest.mark.provokes_pull_failure
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_fail_policy_gives_a_clear_error_within_the_deadline(pd, both, http, stream):
    prompt = prompts(seed=31 + stream, lengths=[300])[0]
    bogus = {
        "do_remote_prefill": True,
        "transfer_id": f"never-issued-{uuid.uuid4()}",
        "producer_engine_id": "nobody",
        "side_channel_host": "127.0.0.2",
        "side_channel_ports": [13004],
        "remote_block_ids": [1, 2, 3],
        "prompt_len": 300,
        "block_size": BLOCK,
        "compat_hash": "0" * 64,
    }
    failures0 = both.metric("mooncake_vllm:pull_failures_total")
    t0 = time.monotonic()
    request = body(pd.model, prompt, stream=stream, kv_transfer_params=bogus)
    async with http.post(f"{both.url}/v1/completions", json=request) as resp:
        text = await resp.text()
    assert time.monotonic() - t0 < pd.load_timeout_s + 5
    assert_failed_load(resp.status, text, stream)
    # It is the refused handoff that failed the request: one failed pull.
    await eventually(lambda: both.metric("mooncake_vllm:pull_failures_total") == failures0 + 1)
    # The instance still serves afterwards.
    ref = await complete(http, pd.plain, body(pd.model, prompt))
    got = await complete(http, both, body(pd.model, prompt))
    assert got.token_ids == ref.token_ids
