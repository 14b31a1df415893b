"""Moving KV between engines of different block sizes, for vLLM's CPU attention, through a staging
copy.

vLLM's CPU attention (its ``vec`` kernels, ``cpu-vec`` here) keeps each head's slab of a block as
K column-major, ``[head_size, block_size]`` (element ``d`` of token ``t`` at ``d * block_size +
t``), followed by V row-major, ``[block_size, head_size]``. A head's slab is one byte range; a
token is not, so blocks of another size cannot be filled by byte copies. A pull instead reads the
needed heads' slabs of the remote blocks into a staging buffer (``staging_regions``: one region
per slab, merged where adjacent), then ``scatter_tokens`` rearranges them into the local blocks
with tensor copies. Only this format is re-blocked; any other is refused before a byte moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncake_vllm.core.planning import REBLOCKABLE, MemSegment, PlanError, Region, append_region

__all__ = ["REBLOCKABLE", "scatter_tokens", "staging_bytes_per_block", "staging_regions"]


def staging_bytes_per_block(src: Sequence[MemSegment], heads: int) -> int:
    """Staging bytes one remote block takes: ``heads`` slabs of every segment."""
    return sum(s.unit_len for s in src) * heads


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
        staged = staging.view(layer.dtype)[i * per_layer : (i + 1) * per_layer]
        staged = staged.view(staged_blocks, heads, 2 * bp * head_size)
        # Views only: each run of tokens is copied once, straight from its staged block.
        k = staged[:, :, : bp * head_size].view(staged_blocks, heads, head_size, bp)
        v = staged[:, :, bp * head_size :].view(staged_blocks, heads, bp, head_size)
        flat = layer.view(layer.shape[0], layer.shape[1], 2 * bc * head_size)
        k_dst = flat[:, :, : bc * head_size].view(layer.shape[0], layer.shape[1], head_size, bc)
        v_dst = flat[:, :, bc * head_size :].view(layer.shape[0], layer.shape[1], bc, head_size)
        t = lo
        while t < hi:
            r, src = divmod(t - staged_from_token, bp)
            j, dst = divmod(t - first_token, bc)
            n = min(bp - src, bc - dst, hi - t)
            lb = local_block_ids[j]
            k_dst[lb, local, :, dst : dst + n] = k[r, :, :, src : src + n]
            v_dst[lb, local, dst : dst + n, :] = v[r, :, src : src + n, :]
            t += n
