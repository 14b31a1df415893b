"""Moving KV between engines of different block sizes, for vLLM's CPU attention, through a staging
copy.

vLLM's CPU attention (its ``vec`` kernels, ``cpu-vec`` here) keeps each head's slab of a block as
K column-major, ``[head_size, block_size]`` (element ``d`` of token ``t`` at ``d * block_size +
t``), followed by V row-major, ``[block_size, head_size]``. A head's slab is one byte range; a
token is not, so blocks of another size cannot be filled by byte copies. A pull instead reads the
needed heads' slabs of the remote blocks into a staging buffer (``staging_regions``: one region
per slab, merged where adjacent), then ``scatter_tokens`` rearranges them into the local blocks
with numpy copies of strided views. Only this format is re-blocked; any other is refused before a
byte moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

import numpy as np
import torch

from mooncake_vllm.core.planning import REBLOCKABLE, MemSegment, PlanError, Region, append_region

__all__ = [
    "REBLOCKABLE",
    "StagedChunk",
    "pull_through_staging",
    "run_staged",
    "scatter_tokens",
    "staged_chunks",
    "staging_bytes_per_block",
    "staging_regions",
]


def staging_bytes_per_block(src: Sequence[MemSegment], heads: int) -> int:
    """Staging bytes one remote block takes: ``heads`` slabs of every segment."""
    return sum(s.unit_len for s in src) * heads


@dataclass(frozen=True)
class StagedChunk:
    """Remote blocks ``blocks`` (indices into the pull's block list) of every segment, staged at
    byte ``offset`` of the staging buffer."""

    blocks: range
    offset: int


def staged_chunks(per_block: int, blocks: range, staging_bytes: int) -> list[StagedChunk]:
    """The pull cut into chunks of as many remote blocks (of every segment) as half the staging
    buffer holds, alternating between the two halves, so that one chunk is read while the one
    before is rearranged (``run_staged``). ``per_block``: one remote block's staged bytes, every
    segment (``staging_bytes_per_block``). A pull that fits in one half is one chunk: cutting it
    further (by layers) costs reads and gained nothing on two shared cores
    (``benchmarks.transfer``). Raises PlanError when one block of every segment does not fit in
    a half."""
    half = staging_bytes // 2 // 64 * 64  # each half aligned for any dtype's view
    if per_block > half:
        raise PlanError(
            f"reblock_buffer_bytes {staging_bytes} is below two remote blocks' {2 * per_block} B "
            "(one per staging half); raise it"
        )
    step = half // per_block
    return [
        StagedChunk(range(b, min(blocks.stop, b + step)), half * (i % 2))
        for i, b in enumerate(range(blocks.start, blocks.stop, step))
    ]


def run_staged(
    chunks: Sequence[StagedChunk],
    read: Callable[[StagedChunk], object],
    rearrange: Callable[[StagedChunk], object],
    submit: Callable[[Callable[[], object]], Future],
) -> None:
    """``read`` each chunk into staging (on ``submit``'s thread) while the chunk before it is
    ``rearrange``d (on this one). Two chunks in flight at most, in the two halves of the buffer;
    raises the first failure, and returns only when no read is writing into the buffer."""
    pending: Future | None = submit(lambda: read(chunks[0])) if chunks else None
    try:
        for i, chunk in enumerate(chunks):
            assert pending is not None
            done, pending = pending, None
            done.result()
            if i + 1 < len(chunks):
                pending = submit(lambda c=chunks[i + 1]: read(c))
            rearrange(chunk)
    finally:
        if pending is not None:  # a failure left a read running: it writes into the buffer
            wait([pending])


def staging_regions(
    src: Sequence[MemSegment],
    staging_addr: int,
    *,
    heads: Sequence[int],
    src_heads: range,
    remote_block_ids: Sequence[int],
) -> list[Region]:
    """Copies of ``heads``' slabs of ``remote_block_ids`` in every segment into staging, laid
    out ``[segment][block][head]``."""
    regions: list[Region] = []
    offset = staging_addr
    for s in src:
        if s.token_stride or not s.unit_len:
            raise PlanError("staging copies whole head slabs: the remote segment is not in slabs")
        for rb in remote_block_ids:
            block = s.base_addr + rb * s.block_stride
            for h in heads:
                append_region(
                    regions, block + (h - src_heads.start) * s.head_stride, offset, s.unit_len
                )
                offset += s.unit_len
    return regions


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """``t``'s elements as a numpy view of integers of the same size (bfloat16 has no numpy
    type). numpy copies a strided 64 KiB slice in ~6 us where torch's setitem takes ~25 us, most
    of it per-call overhead, and a scatter is hundreds of such copies."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


def scatter_tokens(
    staging: torch.Tensor,
    layers: Sequence[torch.Tensor],
    *,
    head_size: int,
    first_head: int,
    heads: int,
    src_block_size: int,
    dst_block_size: int,
    staged_from_token: int,
    staged_blocks: int,
    first_token: int,
    end_token: int,
    local_block_ids: Sequence[int],
) -> None:
    """Writes the staged tokens that fall in ``[first_token, end_token)`` into ``layers`` (one
    ``[num_blocks, heads_local, dst_block_size, 2 * head_size]`` tensor per segment, in segment
    order) at local heads ``first_head .. first_head + heads``. The staging holds
    ``staged_blocks`` remote blocks per layer starting at token ``staged_from_token``; local
    block ``i`` holds tokens from ``first_token + i * dst_block_size``."""
    bp, bc = src_block_size, dst_block_size
    lo = max(first_token, staged_from_token)
    hi = min(end_token, staged_from_token + staged_blocks * bp)
    if lo >= hi:
        return
    per_layer = staged_blocks * heads * 2 * bp * head_size
    local = slice(first_head, first_head + heads)
    for i, layer in enumerate(layers):
        staged = _as_numpy(staging.view(layer.dtype)[i * per_layer : (i + 1) * per_layer])
        staged = staged.reshape(staged_blocks, heads, 2 * bp * head_size)
        # Views only: each run of tokens is copied once, straight from its staged block.
        k = staged[:, :, : bp * head_size].reshape(staged_blocks, heads, head_size, bp)
        v = staged[:, :, bp * head_size :].reshape(staged_blocks, heads, bp, head_size)
        flat = _as_numpy(layer).reshape(layer.shape[0], layer.shape[1], 2 * bc * head_size)
        k_dst = flat[:, :, : bc * head_size].reshape(layer.shape[0], layer.shape[1], head_size, bc)
        v_dst = flat[:, :, bc * head_size :].reshape(layer.shape[0], layer.shape[1], bc, head_size)
        t = lo
        while t < hi:
            r, src = divmod(t - staged_from_token, bp)
            j, dst = divmod(t - first_token, bc)
            n = min(bp - src, bc - dst, hi - t)
            lb = local_block_ids[j]
            k_dst[lb, local, :, dst : dst + n] = k[r, :, :, src : src + n]
            v_dst[lb, local, dst : dst + n, :] = v[r, :, src : src + n, :]
            t += n


def pull_through_staging(
    *,
    staging: torch.Tensor,
    src: Sequence[MemSegment],
    layers: Sequence[torch.Tensor],
    heads: Sequence[int],
    src_heads: range,
    first_head: int,
    src_block_size: int,
    dst_block_size: int,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    first_token: int,
    end_token: int,
    read: Callable[[list[Region]], object],
    before_writing: Callable[[], object],
    submit: Callable[[Callable[[], object]], Future],
) -> float:
    """A pull from a producer of another block size: ``heads`` (``src_heads`` at the producer;
    local heads from ``first_head``) of the remote blocks holding tokens ``[first_token,
    end_token)``, read into ``staging`` (registered with the engine) by ``read(regions)`` a chunk
    at a time (``staged_chunks``) and rearranged into ``layers`` (``scatter_tokens``) while the
    next chunk is read (``run_staged``). ``before_writing`` is called before each rearrangement
    (it raises to stop before a block is touched). Returns the seconds spent rearranging."""
    chunks = staged_chunks(
        staging_bytes_per_block(src, len(heads)),
        range(first_token // src_block_size, -(-end_token // src_block_size)),
        staging.numel(),
    )
    head_size = src[0].unit_len // (2 * src_block_size * layers[0].element_size())
    rearranging = 0.0

    def read_chunk(c: StagedChunk) -> None:
        read(
            staging_regions(
                src,
                staging.data_ptr() + c.offset,
                heads=heads,
                src_heads=src_heads,
                remote_block_ids=remote_block_ids[c.blocks.start : c.blocks.stop],
            )
        )

    def rearrange(c: StagedChunk) -> None:
        nonlocal rearranging
        before_writing()
        t0 = time.perf_counter()
        scatter_tokens(
            staging[c.offset :],
            layers,
            head_size=head_size,
            first_head=first_head,
            heads=len(heads),
            src_block_size=src_block_size,
            dst_block_size=dst_block_size,
            staged_from_token=c.blocks.start * src_block_size,
            staged_blocks=len(c.blocks),
            first_token=first_token,
            end_token=end_token,
            local_block_ids=local_block_ids,
        )
        rearranging += time.perf_counter() - t0

    run_staged(chunks, read_chunk, rearrange, submit)
    return rearranging
