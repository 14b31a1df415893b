"""Re-blocking through staging, checked against vLLM's own CPU attention kernel: K and V written by
``cpu_attn_reshape_and_cache`` into a producer cache of one block size, staged slab by slab (by
byte copies, as the transfer engine would) and scattered into a consumer cache of another block
size, must equal what the kernel itself writes into that consumer cache (no servers)."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch
from vllm import _custom_ops as ops

from mooncake_vllm.core.planning import PlanError, rank_heads, tensor_segments
from mooncake_vllm.core.reblock import (
    scatter_tokens,
    staging_bytes_per_block,
    staging_regions,
)

HEADS, HEAD_SIZE, LAYERS = 4, 64, 2


def _cache(num_blocks: int, heads: int, block_size: int, dtype) -> torch.Tensor:
    return torch.zeros(num_blocks, heads, block_size, 2 * HEAD_SIZE, dtype=dtype)


def _write(cache: torch.Tensor, k, v, slots: list[int]) -> None:
    """vLLM's CPU attention writing K and V of these tokens at these slots."""
    nb, h, b, _ = cache.shape
    key_cache, value_cache = cache.view(nb, h, 2 * b, HEAD_SIZE).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.tensor(slots), "vec")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("src_block", "dst_block", "prompt", "cached_blocks", "chunk"),
    [
        (128, 64, 300, 0, 8),
        (64, 128, 300, 0, 8),
        (32, 128, 257, 1, 2),  # a local prefix hit of one 128-token block, staged 2 at a time
        (128, 32, 100, 2, 1),
        (96, 64, 191, 1, 1),
    ],
)
@pytest.mark.parametrize(("consumer_tp", "rank"), [(1, 0), (2, 1)])
def test_staged_tokens_land_where_the_kernel_puts_them(
    dtype, src_block, dst_block, prompt, cached_blocks, chunk, consumer_tp, rank
):
    rng = random.Random(src_block * 1000 + prompt)
    torch.manual_seed(prompt)
    keys = [torch.randn(prompt, HEADS, HEAD_SIZE).to(dtype) for _ in range(LAYERS)]
    values = [torch.randn(prompt, HEADS, HEAD_SIZE).to(dtype) for _ in range(LAYERS)]

    # The producer (TP1): every head, its prompt in shuffled blocks.
    n_remote = -(-prompt // src_block)
    remote = rng.sample(range(n_remote + 3), n_remote)
    producer = [_cache(n_remote + 3, HEADS, src_block, dtype) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        slots = [remote[t // src_block] * src_block + t % src_block for t in range(prompt)]
        _write(producer[layer], keys[layer], values[layer], slots)

    # The consumer rank: its heads, the prompt from its first uncached block on.
    heads = rank_heads(HEADS, consumer_tp, rank)
    first = cached_blocks * dst_block
    n_local = -(-prompt // dst_block) - cached_blocks
    local = rng.sample(range(n_local + 4), n_local)
    slots = [
        local[(t - first) // dst_block] * dst_block + t % dst_block for t in range(first, prompt)
    ]
    expected, consumer = [], []
    for layer in range(LAYERS):
        cache = _cache(n_local + 4, len(heads), dst_block, dtype)
        part = slice(heads.start, heads.stop)
        _write(cache, keys[layer][first:, part], values[layer][first:, part], slots)
        expected.append(cache)
        consumer.append(torch.zeros_like(cache))

    segments = []
    for cache in producer:
        segments += tensor_segments(
            cache.data_ptr(),
            cache.shape,
            cache.stride(),
            cache.element_size(),
            cache.shape[0],
            block_size=src_block,
            heads=HEADS,
            tokens_addressable=False,
        )
    staging = torch.empty(chunk * staging_bytes_per_block(segments, len(heads)), dtype=torch.uint8)
    r0, r1 = first // src_block, n_remote
    for c0 in range(r0, r1, chunk):
        c1 = min(r1, c0 + chunk)
        regions = staging_regions(
            segments,
            staging.data_ptr(),
            heads=list(heads),
            src_heads=range(HEADS),
            remote_block_ids=remote[c0:c1],
        )
        for r in regions:  # what the transfer engine's read does
            assert staging.data_ptr() <= r.dst_addr
            assert r.dst_addr + r.length <= staging.data_ptr() + staging.numel()
            ctypes.memmove(r.dst_addr, r.src_addr, r.length)
        scatter_tokens(
            staging,
            consumer,
            head_size=HEAD_SIZE,
            first_head=0,
            heads=len(heads),
            src_block_size=src_block,
            dst_block_size=dst_block,
            staged_from_token=c0 * src_block,
            staged_blocks=c1 - c0,
            first_token=first,
            end_token=prompt,
            local_block_ids=local,
        )
    for got, want in zip(consumer, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_staging_needs_slabs():
    segment = tensor_segments(0, (4, 2, 32, 16), (1024, 512, 16, 1), 4, 4, block_size=32, heads=2)
    with pytest.raises(PlanError, match="slabs"):
        staging_regions(segment, 0, heads=[0], src_heads=range(2), remote_block_ids=[1])
