"""Image prompts through the pair: a tiny random-weight Idefics3 (``harness.tiny_model.
build_tiny_vlm``: a vision tower, a connector, a two-layer Llama; PIL's image processor) served
by a plain vLLM, a prefill and a decode on one address, vLLM's default ``fail`` policy.

The prefill runs the vision encoder and computes the prompt, image tokens included; the decode
is sent the same chat (images and all) with the handoff, pulls every prompt token's KV and
computes only the last one, so it never runs the encoder. Answers are compared token for token
with the plain vLLM's; two images behind the same placeholder tokens give different answers, and
a handoff of one image is refused for a request with the other (the lease's prompt binding
carries the inputs' hashes).
"""

from __future__ import annotations

import asyncio
import base64
import io

import pytest

from harness.pd import (
    PULL_COUNTERS,
    ServerSpec,
    eventually,
    kv_args,
    mooncake_json,
    pulls_since,
    reference_spec,
    start_many,
    stop_servers,
    tokens_by_transfer,
)
from harness.tiny_model import build_tiny_vlm
from tests.test_concurrent_e2e import nothing_held

pytestmark = pytest.mark.servers

HOST = "127.0.0.9"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, request):
    model = str(build_tiny_vlm())
    cfg = mooncake_json(tmp_path_factory.mktemp("vlm") / "mooncake.json",
                        prefill_url=f"{HOST}:13240", decode_url=f"{HOST}:13250")  # fmt: skip
    env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
    specs = [
        reference_spec("plain-vlm", HOST),
        ServerSpec("prefill-vlm", HOST, kv_args("kv_producer"), env),
        ServerSpec("decode-vlm", HOST, kv_args("kv_consumer"), env),
    ]
    started = start_many(model, specs)
    yield dict(zip(("plain", "prefill", "decode"), started, strict=True), model=model)
    stop_servers(started, print_logs=request.session.testsfailed > 0)


def image(seed: int) -> str:
    """A 64x64 PNG of random colours as a data URL."""
    import random

    from PIL import Image

    rng = random.Random(seed)
    img = Image.new("RGB", (64, 64))
    img.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(64 * 64)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(model: str, images: list[int], words: str, **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image(i)}} for i in images]
    content.append({"type": "text", "text": words})
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            **extra}  # fmt: skip


async def post(http, srv, body: dict) -> dict:
    async with http.post(f"{srv.url}/v1/chat/completions", json=body) as resp:
        data = await resp.json(content_type=None)
        assert resp.status == 200, data
        return data


def answer(data: dict) -> tuple[list[int], str]:
    choice = data["choices"][0]
    return list(choice.get("token_ids") or []), choice["message"]["content"]


CASES = [([1], "what is this"), ([2], "what is this"), ([1, 2], "compare the two"),
         ([3], "describe " * 40), ([4], "and this one?"), ([5, 6, 7], "three images")]  # fmt: skip


async def test_image_prompts_are_pulled_whole_and_answer_as_plain(vlm, http):
    plain, prefill, decode = vlm["plain"], vlm["prefill"], vlm["decode"]
    bodies = [chat(vlm["model"], imgs, words) for imgs, words in CASES]
    refs = [answer(await post(http, plain, b)) for b in bodies]
    assert refs[0] != refs[1]  # two images behind the same tokens answer apart
    before, ext0 = PULL_COUNTERS.read(decode), tokens_by_transfer(decode)
    sem = asyncio.Semaphore(8)

    async def one(body):
        async with sem:
            head = await post(http, prefill, {**body, "max_tokens": 1,
                              "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
            tail = await post(
                http, decode, {**body, "kv_transfer_params": head["kv_transfer_params"]}
            )
            return head["usage"]["prompt_tokens"], answer(tail)

    got = await asyncio.gather(*(one(b) for b in bodies))
    assert [a for _, a in got] == refs
    moved = await pulls_since(decode, before, len(bodies))
    assert (moved["pulls"], moved["pull_failures"]) == (len(bodies), 0)
    prompt_tokens = sum(n for n, _ in got)
    assert tokens_by_transfer(decode) - ext0 >= 0.99 * (prompt_tokens - len(bodies))
    await eventually(lambda: nothing_held(prefill) and nothing_held(decode), 15, "freed")


@pytest.mark.provokes_pull_failure
async def test_a_handoff_of_one_image_is_refused_for_the_other(vlm, http):
    prefill, decode = vlm["prefill"], vlm["decode"]
    head = await post(http, prefill, chat(vlm["model"], [8], "which", max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True}))  # fmt: skip
    before = PULL_COUNTERS.read(decode)
    body = chat(vlm["model"], [9], "which", kv_transfer_params=head["kv_transfer_params"])
    async with http.post(f"{decode.url}/v1/chat/completions", json=body) as resp:
        assert resp.status >= 400, await resp.text()  # vLLM's fail policy
    moved = await pulls_since(decode, before, 1)
    assert (moved["pull_failures"], moved["bytes"]) == (1, 0)
    await eventually(lambda: nothing_held(prefill) and nothing_held(decode), 15, "freed")
