"""Image prompts through the pool: the tiny Idefics3 of ``test_multimodal_e2e`` served by a real
mooncake_master, a producer and a decode of ``MooncakeStoreConnector`` and a plain vLLM, every
engine on one address, vLLM's default ``fail`` policy, the minimal proxy's flow (the producer
with ``max_tokens=1``, then the decode, nothing passed between).

A block's pool key carries the hashes of the images that overlap it, as vLLM's prefix-cache keys
do (``pool.keys``): each image's prompt comes to the decode from the pool and answers as the plain
vLLM does; the same tokens with another image behind its placeholders find nothing there and
are computed.
"""

from __future__ import annotations

import asyncio

import pytest
from test_multimodal_e2e import answer, chat, post

from harness.pd import POOL_COUNTERS, eventually, stop_servers, tokens_by_transfer
from harness.pool_hosts import start_pool_trio
from harness.tiny_model import build_tiny_vlm

pytestmark = pytest.mark.servers


@pytest.fixture(scope="module")
def pool(tmp_path_factory, request):
    model = str(build_tiny_vlm())
    master, engines = start_pool_trio(model, "pool-vlm", tmp_path_factory.mktemp("pool-vlm"))
    yield {**engines, "model": model}
    stop_servers([master, *engines.values()], print_logs=request.session.testsfailed > 0)


def failures(srv, before) -> tuple[float, float]:
    moved = POOL_COUNTERS.since(srv, before)
    return moved["load_failures"], moved["put_failures"]


async def test_each_images_prompt_comes_from_the_pool_and_answers_as_plain(pool, http):
    prefill, decode = pool["prefill"], pool["decode"]
    cases = [([11], "what is this " * 30), ([12], "what is this " * 30),
             ([13, 14], "compare " * 50), ([15], "one more " * 80)]  # fmt: skip
    bodies = [chat(pool["model"], imgs, words) for imgs, words in cases]
    refs = [answer(await post(http, pool["plain"], b)) for b in bodies]
    p0, d0, ext0 = (
        POOL_COUNTERS.read(prefill),
        POOL_COUNTERS.read(decode),
        tokens_by_transfer(decode),
    )

    async def one(body):
        head = await post(http, prefill, {**body, "max_tokens": 1})
        return head["usage"]["prompt_tokens"], answer(await post(http, decode, body))

    got = await asyncio.gather(*(one(b) for b in bodies))
    assert [a for _, a in got] == refs
    total = sum(n for n, _ in got)
    ext = tokens_by_transfer(decode) - ext0
    print(f"\npool with images: {ext:.0f} of {total} prompt tokens from the pool")
    assert ext >= 0.95 * total
    assert failures(prefill, p0) == failures(decode, d0) == (0, 0)


async def test_a_prompt_put_with_one_image_is_not_found_with_another(pool, http):
    prefill, decode = pool["prefill"], pool["decode"]
    words = "describe " * 60  # the image's tokens in block 0, text filling the next blocks
    p0 = POOL_COUNTERS.read(prefill)
    await post(http, prefill, chat(pool["model"], [21], words, max_tokens=1))
    await eventually(lambda: POOL_COUNTERS.since(prefill, p0)["put_blocks"] > 0)
    other = chat(pool["model"], [22], words)
    ref = answer(await post(http, pool["plain"], other))
    d0, ext0 = POOL_COUNTERS.read(decode), tokens_by_transfer(decode)
    assert answer(await post(http, decode, other)) == ref
    moved = POOL_COUNTERS.since(decode, d0)
    assert moved["lookups"] >= 1 and moved["hit_blocks"] == 0, moved
    assert tokens_by_transfer(decode) - ext0 == 0
    # ... and with its own image, the same tokens do come from the pool.
    mine = chat(pool["model"], [21], words)
    assert answer(await post(http, decode, mine)) == answer(await post(http, pool["plain"], mine))
    assert tokens_by_transfer(decode) - ext0 > 0
    assert failures(decode, d0) == (0, 0)
