"""Pure block → memory-region math for a pull.

A KV cache tensor is seen as one or more *segments*: runs of equally sized blocks at a fixed stride
(e.g. a ``(2, num_blocks, ...)`` layer tensor gives a K segment and a V segment; a block-first view
such as an MLA layer's ``(num_blocks, 1, block_size, latent)`` gives one). Only the tensors' own
shapes and strides are read, so any layout vLLM allocates is planned as it is. A pull copies, for
every segment, remote block ``r[i]`` to local block ``l[i]``; consecutive copies that are contiguous
on both sides are merged, and the result is cut into batches the transfer engine accepts.

Which producer rank a consumer rank reads (``producer_rank_for``) is decided here too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import msgspec


class Region(NamedTuple):
    src_addr: int
    dst_addr: int
    length: int


class PlanError(ValueError):
    pass


class MemSegment(msgspec.Struct, frozen=True, array_like=True):
    """Where block ``b`` of one KV region lives: ``base_addr + b * block_stride``."""

    base_addr: int
    block_stride: int
    block_len: int


def kv_cache_regions(kv_caches, num_blocks: int) -> tuple[list[MemSegment], dict[int, tuple]]:
    """Every layer's KV tensor (``name → tensor``, enumerated by name, as every engine does) as
    memory segments, and the distinct storages behind them (``address → (bytes, a tensor on
    it)``), which is what a transfer engine registers."""
    segments: list[MemSegment] = []
    storages: dict[int, tuple] = {}
    for name in sorted(kv_caches):
        t = kv_caches[name]
        segments += tensor_segments(
            t.data_ptr(), tuple(t.shape), t.stride(), t.element_size(), num_blocks
        )
        st = t.untyped_storage()
        storages[st.data_ptr()] = (st.nbytes(), t)
    return segments, storages


def tensor_segments(
    data_ptr: int, shape: Sequence[int], strides: Sequence[int], itemsize: int, num_blocks: int
) -> list[MemSegment]:
    """Segments of one KV tensor whose block dimension is the first of size ``num_blocks``.

    Dimensions after the block dimension must be contiguous (one block = one byte range).
    """
    try:
        d = list(shape).index(num_blocks)
    except ValueError:
        raise PlanError(f"no dimension of size num_blocks={num_blocks} in shape {shape}") from None
    inner = math.prod(shape[d + 1 :])
    expected = 1
    for size, stride in zip(reversed(shape[d + 1 :]), reversed(strides[d + 1 :]), strict=True):
        if size > 1 and stride != expected:
            raise PlanError(f"block interior of shape {shape} strides {strides} is not contiguous")
        expected *= size
    block_len = inner * itemsize
    block_stride = strides[d] * itemsize
    segments = []
    for outer in itertools.product(*(range(n) for n in shape[:d])):
        offset = sum(i * s for i, s in zip(outer, strides[:d], strict=True)) * itemsize
        segments.append(MemSegment(data_ptr + offset, block_stride, block_len))
    return segments


def plan_regions(
    src: Sequence[MemSegment],
    dst: Sequence[MemSegment],
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
) -> list[Region]:
    """Copies for ``src_block_ids[i] → dst_block_ids[i]`` in every segment, merged."""
    if len(src) != len(dst):
        raise PlanError(f"{len(src)} remote segments vs {len(dst)} local ones")
    if len(src_block_ids) != len(dst_block_ids):
        raise PlanError(f"{len(src_block_ids)} remote blocks vs {len(dst_block_ids)} local ones")
    regions: list[Region] = []
    for s, d in zip(src, dst, strict=True):
        if s.block_len != d.block_len:
            raise PlanError(f"block length {s.block_len} (remote) vs {d.block_len} (local)")
        for rb, lb in zip(src_block_ids, dst_block_ids, strict=True):
            src_addr = s.base_addr + rb * s.block_stride
            dst_addr = d.base_addr + lb * d.block_stride
            if regions:
                last = regions[-1]
                if (
                    last.src_addr + last.length == src_addr
                    and last.dst_addr + last.length == dst_addr
                ):
                    regions[-1] = Region(last.src_addr, last.dst_addr, last.length + s.block_len)
                    continue
            regions.append(Region(src_addr, dst_addr, s.block_len))
    return regions


def producer_rank_for(
    consumer_rank: int, consumer_tp_size: int, producer_tp_size: int, kv_replicated: bool
) -> int:
    """The producer TP rank that consumer TP rank ``consumer_rank`` pulls its KV from.

    Per-head K/V is sharded by head across TP ranks: both sides must have the same TP size, and
    rank r holds (and pulls) shard r. An MLA latent is replicated: every producer rank holds the
    whole latent, so each consumer rank pulls it once, from one producer rank, whatever the two
    TP sizes are; consumer ranks are spread over producer ranks (r mod producer TP size).
    """
    if not 0 <= consumer_rank < consumer_tp_size:
        raise PlanError(f"consumer rank {consumer_rank} outside TP size {consumer_tp_size}")
    if producer_tp_size < 1:
        raise PlanError(f"producer TP size {producer_tp_size} must be at least 1")
    if kv_replicated:
        return consumer_rank % producer_tp_size
    if producer_tp_size != consumer_tp_size:
        raise PlanError(
            f"per-head K/V is sharded by TP rank: producer TP {producer_tp_size} cannot serve "
            f"consumer TP {consumer_tp_size}"
        )
    return consumer_rank
