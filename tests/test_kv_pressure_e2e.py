"""Long prompts past the KV cache: a decode that holds only a few of them, a prefill that holds
one more, eight clients at once.

A prefill and a decode of their own, each with a KV cache cut down by vLLM's own
``--num-gpu-blocks-override``: the decode holds two of the 4 200-token prompts sent here (33
blocks each, 66 of its 70 blocks), the prefill four. With eight clients at once the prefill's
other requests wait for blocks while the producer holds finished prompts for their pulls, and
the decode (its legs sent with the prefill's, ``--dispatch concurrent``) admits two at a time,
each of which grows by three blocks over its 320-token answer with four blocks free: vLLM
preempts a running request and re-admits it later (recomputing what it dropped). Nothing of
that may show in the answers: each equals the plain vLLM's (the shared cluster's, at
``--max-model-len`` 16 384); a pull fails only when its request waited in the decode's queue
past the prefill's ``lease_ttl_s``, and then the proxy sends it again, up to three times (a
re-sent request queues again; vLLM's default policy makes the failure a 500 the client never
sees); at the end neither side holds a lease or a block. The producer's held bytes, sampled
while the load runs, never exceed its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest

from harness import servers
from harness.pd import PULL_COUNTERS, client_session, complete, greedy_body, kv_args
from harness.xpyd import start_proxy

pytestmark = [pytest.mark.servers, pytest.mark.long]  # ~280 s with its own pair: make test-long

PREFILL_HOST, DECODE_HOST = "127.0.0.41", "127.0.0.42"
TE_PORT = 14410
BLOCK = 128  # vLLM's CPU block size
PREFILL_BLOCKS = 160  # 20 480 tokens: four prompts
DECODE_BLOCKS = 70  # 8 960 tokens: two prompts, then four blocks to grow into
PROMPT_TOKENS = 4200  # 33 blocks
MAX_MODEL_LEN = 8192  # at most what the smaller cache holds (vLLM refuses a longer one)
CONCURRENCY = 8
REQUESTS = 16
MAX_TOKENS = 320  # three blocks past the prompt's: two answers at once need six


@pytest.fixture(scope="module")
def tight_pair(tiny_model, cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pressure")
    started: list = []
    try:

        def start(role, host, blocks):
            own = "prefill_url" if role == "kv_producer" else "decode_url"
            args = kv_args(role, {own: f"{host}:{TE_PORT}"})
            args += ["--num-gpu-blocks-override", str(blocks)]
            srv = servers.start_vllm(
                tiny_model, name=f"pressure-{role}", host=host, args=args, log_dir=tmp,
                max_model_len=MAX_MODEL_LEN,
            )  # fmt: skip
            started.append(srv)
            return srv

        prefill = start("kv_producer", PREFILL_HOST, PREFILL_BLOCKS)
        decode = start("kv_consumer", DECODE_HOST, DECODE_BLOCKS)
        # Concurrent dispatch: each decode leg goes out with its prefill leg, so the decode
        # admits three requests at once (their blocks allocated while their prompts are computed)
        # however the prefills happen to finish.
        proxy = start_proxy(["--prefill", prefill.url, "--decode", decode.url,
                             "--dispatch", "concurrent"])  # fmt: skip
        started.append(proxy)
        proxy.wait_for("both in rotation", lambda: proxy.health()["status"] == "ok", 60)
        yield cluster.plain, prefill, decode, proxy
    finally:
        for srv in reversed(started):
            srv.stop()


async def test_preempted_and_waiting_requests_answer_token_exact(tiny_model, tight_pair):
    plain, prefill, decode, proxy = tight_pair
    rng = random.Random(41)
    prompts = [[rng.randrange(3, 2048) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]
    pulls0 = PULL_COUNTERS.read(decode)
    preempted0 = decode.metric("vllm:num_preemptions_total")
    reloaded0 = proxy.metric("mooncake_proxy_dispatched_total", how="reloaded")
    held_samples: list[float] = []
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            with contextlib.suppress(Exception):
                held_samples.append(prefill.metric("mooncake_vllm:held_bytes"))
            await asyncio.sleep(0.5)

    sem = asyncio.Semaphore(CONCURRENCY)
    async with client_session() as http:

        async def one(i):
            async with sem:
                body = greedy_body(tiny_model, prompts[i], MAX_TOKENS, stream=i % 2 == 1)
                return (await complete(http, proxy.url, body)).token_ids

        sampler = asyncio.create_task(sample())
        t0 = time.monotonic()
        answers = await asyncio.gather(*(one(i) for i in range(REQUESTS)))
        took_s = time.monotonic() - t0
        done.set()
        await sampler
        references = [
            (await complete(http, plain, greedy_body(tiny_model, p, MAX_TOKENS))).token_ids
            for p in prompts
        ]
    pulled = PULL_COUNTERS.since(decode, pulls0)
    preempted = decode.metric("vllm:num_preemptions_total") - preempted0
    reloaded = proxy.metric("mooncake_proxy_dispatched_total", how="reloaded") - reloaded0
    kv_bytes_per_token = 4 * 2 * 4 * 64 * 4  # the tiny model: layers × K,V × heads × dim × fp32
    budget = PREFILL_BLOCKS * BLOCK * kv_bytes_per_token
    print(
        f"{REQUESTS} prompts of {sum(map(len, prompts)) // REQUESTS} tokens on average, c="
        f"{CONCURRENCY}: {took_s:.0f}s, decode preemptions {preempted:.0f}, pulls {pulled}, "
        f"requests sent again by the proxy {reloaded:.0f}, "
        f"producer held at most {max(held_samples, default=0) / 2**20:.0f} MiB of "
        f"{budget / 2**20:.0f} MiB ({len(held_samples)} samples)"
    )
    unequal = [i for i, (a, r) in enumerate(zip(answers, references, strict=True)) if a != r]
    assert not unequal, unequal
    # A request that waits in the decode's queue past the prefill's lease_ttl_s (30 s) finds its
    # lease expired: the pull fails (vLLM's default policy: a 500 the client never sees) and the
    # proxy sends both legs again. Every failed pull must be one the proxy re-did.
    assert pulled["pull_failures"] == reloaded, (pulled, reloaded)
    assert pulled["pulls"] >= REQUESTS, pulled
    # With three blocks of answer each and four free, two answers decoding at once preempt.
    # (The previous layout, three prompts in 100 blocks and a block of answer each, preempted
    # in 1 of 4 runs: the answers rarely overlapped.)
    assert preempted >= 1, "the decode never ran out of blocks: the layout did not press"
    assert held_samples and max(held_samples) <= budget
    await asyncio.sleep(1.0)  # the last step's gauges
    assert prefill.metric("mooncake_vllm:held_leases") == 0
    for srv in (prefill, decode):
        assert srv.metric("vllm:kv_cache_usage_perc") == pytest.approx(0.0, abs=1e-9), srv.url
