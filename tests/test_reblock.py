"""Re-blocking through staging, checked against vLLM's own CPU attention kernel: K and V written by
``cpu_attn_reshape_and_cache`` into a producer cache of one block size, staged slab by slab (by
byte copies, as the transfer engine would) and scattered into a consumer cache of another block
size, must equal what the kernel itself writes into that consumer cache (no servers)."""

from __future__ import annotations

import ctypes
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from vllm import _custom_ops as ops

from mooncake_vllm.core.planning import PlanError, rank_heads, tensor_segments
from mooncake_vllm.core.reblock import (
    StagedChunk,
    pull_through_staging,
    run_staged,
    staged_chunks,
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
    # ``chunk`` remote blocks of every layer per staging half, read and rearranged as the decode
    # worker does.
    per_block = staging_bytes_per_block(segments, len(heads))
    staging = torch.empty(2 * chunk * per_block + 128, dtype=torch.uint8)
    chunks = staged_chunks(per_block, range(first // src_block, n_remote), staging.numel())
    covered = [b for c in chunks for b in c.blocks]
    assert covered == list(range(first // src_block, n_remote))  # each remote block once
    copied = []

    def read(regions) -> None:
        for r in regions:  # what the transfer engine's read does
            assert staging.data_ptr() <= r.dst_addr
            assert r.dst_addr + r.length <= staging.data_ptr() + staging.numel()
            ctypes.memmove(r.dst_addr, r.src_addr, r.length)
            copied.append(r.length)

    with ThreadPoolExecutor(1) as reads:
        pull_through_staging(
            staging=staging, src=segments, layers=consumer, heads=list(heads),
            src_heads=range(HEADS), first_head=0, src_block_size=src_block,
            dst_block_size=dst_block, remote_block_ids=remote, local_block_ids=local,
            first_token=first, end_token=prompt, read=read, before_writing=lambda: None,
            submit=reads.submit,
        )  # fmt: skip
    assert sum(copied) == len(covered) * per_block  # the needed heads' slabs, once
    for got, want in zip(consumer, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_staging_needs_slabs():
    segment = tensor_segments(0, (4, 2, 32, 16), (1024, 512, 16, 1), 4, 4, block_size=32, heads=2)
    with pytest.raises(PlanError, match="slabs"):
        staging_regions(segment, 0, heads=[0], src_heads=range(2), remote_block_ids=[1])


def test_chunks_alternate_halves_and_cover_the_pull_once():
    half = 2 * 64 * 100 // 2 // 64 * 64
    # Fits in half the buffer: one chunk.
    assert staged_chunks(600, range(2, 5), 2 * 64 * 100) == [StagedChunk(range(2, 5), 0)]
    # Larger than half: as many blocks of every segment as a half holds, halves alternating.
    big = staged_chunks(600, range(0, 25), 2 * 64 * 100)
    assert big == [
        StagedChunk(range(0, 10), 0), StagedChunk(range(10, 20), half),
        StagedChunk(range(20, 25), 0),
    ]  # fmt: skip
    with pytest.raises(PlanError, match="reblock_buffer_bytes 1000 is below two remote blocks"):
        staged_chunks(600, range(0, 3), 1000)


def test_a_chunk_is_read_while_the_one_before_is_rearranged_never_into_its_half():
    chunks = staged_chunks(256, range(0, 40), 2 * 64 * 64 * 4 // 5)
    assert len(chunks) >= 4
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def log(what: str, c: StagedChunk) -> None:
        with lock:
            events.append((what, chunks.index(c)))

    def read(c: StagedChunk) -> None:
        log("read", c)
        time.sleep(0.01)
        log("read done", c)

    def rearrange(c: StagedChunk) -> None:
        log("rearrange", c)
        time.sleep(0.01)
        log("rearrange done", c)

    with ThreadPoolExecutor(1) as reads:
        run_staged(chunks, read, rearrange, reads.submit)
    at = {e: i for i, e in enumerate(events)}
    for i in range(len(chunks)):
        assert at[("read done", i)] < at[("rearrange", i)]
        if i + 1 < len(chunks):  # the next read overlaps this rearrangement
            assert at[("read", i + 1)] < at[("rearrange done", i)]
        if i + 2 < len(chunks):  # but not into the half this one still uses
            assert at[("rearrange done", i)] < at[("read", i + 2)]


@pytest.mark.parametrize("fails", ["read", "rearrange"])
def test_a_failure_is_raised_once_no_read_still_writes(fails):
    chunks = staged_chunks(128, range(0, 10), 2 * 64 * 2 * 3)
    running = threading.Event()

    def read(c: StagedChunk) -> None:
        running.set()
        time.sleep(0.05)
        running.clear()
        if fails == "read" and c is chunks[1]:
            raise OSError("read failed")

    def rearrange(c: StagedChunk) -> None:
        if fails == "rearrange" and c is chunks[0]:
            raise RuntimeError("rearrange failed")

    with ThreadPoolExecutor(1) as reads:
        with pytest.raises((OSError, RuntimeError), match=f"{fails} failed"):
            run_staged(chunks, read, rearrange, reads.submit)
        assert not running.is_set()  # returned only once the read in flight had ended
