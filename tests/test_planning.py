"""Region planning: remote → local block copies merged into the fewest transfer-engine entries,
and KV layouts it must refuse."""

from __future__ import annotations

import pytest

from mooncake_vllm.planning import PlanError, Region, plan_regions, tensor_segments
from mooncake_vllm.protocol import (
    MemSegment,
)

# ---- planning -------------------------------------------------------------------------------

BLOCK = 64  # bytes per block in the synthetic segments below


def _seg(base: int, stride: int = BLOCK, block_len: int = BLOCK) -> MemSegment:
    return MemSegment(base, stride, block_len)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "expected"),
    [
        # contiguous on both sides: one region
        ([0, 1, 2, 3], [4, 5, 6, 7], [Region(0, 4 * BLOCK, 4 * BLOCK)]),
        # contiguous remotely only: one region per block
        ([0, 1], [4, 6], [Region(0, 4 * BLOCK, BLOCK), Region(BLOCK, 6 * BLOCK, BLOCK)]),
        # contiguous locally only
        ([0, 2], [4, 5], [Region(0, 4 * BLOCK, BLOCK), Region(2 * BLOCK, 5 * BLOCK, BLOCK)]),
        # two runs
        (
            [0, 1, 5, 6, 7],
            [0, 1, 2, 3, 4],
            [Region(0, 0, 2 * BLOCK), Region(5 * BLOCK, 2 * BLOCK, 3 * BLOCK)],
        ),
        # descending ids never merge
        ([3, 2], [1, 0], [Region(3 * BLOCK, BLOCK, BLOCK), Region(2 * BLOCK, 0, BLOCK)]),
        # nothing to copy
        ([], [], []),
    ],
)
def test_region_merging_in_one_segment(src_ids, dst_ids, expected):
    assert plan_regions([_seg(0)], [_seg(0)], src_ids, dst_ids) == expected


def test_strided_blocks_do_not_merge():
    # Blocks with padding between them (stride > block_len) are never contiguous.
    src, dst = [_seg(0, stride=2 * BLOCK)], [_seg(0)]
    assert plan_regions(src, dst, [0, 1], [0, 1]) == [
        Region(0, 0, BLOCK),
        Region(2 * BLOCK, BLOCK, BLOCK),
    ]


def test_regions_for_several_layers_and_tensors():
    # Two layers, each a K and a V segment, placed far apart on both sides.
    src = [_seg(1_000_000 * i) for i in range(4)]
    dst = [_seg(5_000_000 + 1_000_000 * i) for i in range(4)]
    regions = plan_regions(src, dst, [2, 3, 9], [0, 1, 7])
    assert len(regions) == 8  # per segment: the run 2-3 → 0-1 and the lone 9 → 7
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        assert regions[2 * i] == Region(s.base_addr + 2 * BLOCK, d.base_addr, 2 * BLOCK)
        assert regions[2 * i + 1] == Region(s.base_addr + 9 * BLOCK, d.base_addr + 7 * BLOCK, BLOCK)


def test_real_kv_tensor_layout_plans_per_k_and_v():
    # A (2, num_blocks, block_size, heads, head_dim) float32 layer, as vLLM allocates it.
    num_blocks, block_size, heads, head_dim, itemsize = 8, 4, 2, 8, 4
    shape = (2, num_blocks, block_size, heads, head_dim)
    block_elems = block_size * heads * head_dim
    strides = (num_blocks * block_elems, block_elems, heads * head_dim, head_dim, 1)
    block_bytes = block_elems * itemsize
    src = tensor_segments(0x10000, shape, strides, itemsize, num_blocks)
    dst = tensor_segments(0x90000, shape, strides, itemsize, num_blocks)
    assert src == [
        MemSegment(0x10000, block_bytes, block_bytes),
        MemSegment(0x10000 + num_blocks * block_bytes, block_bytes, block_bytes),
    ]
    regions = plan_regions(src, dst, [1, 2, 3], [5, 6, 7])
    assert regions == [
        Region(0x10000 + block_bytes, 0x90000 + 5 * block_bytes, 3 * block_bytes),
        Region(
            0x10000 + (num_blocks + 1) * block_bytes,
            0x90000 + (num_blocks + 5) * block_bytes,
            3 * block_bytes,
        ),
    ]


def test_non_contiguous_block_interior_is_refused():
    with pytest.raises(PlanError, match="not contiguous"):
        tensor_segments(0, (4, 2, 8), (16, 1, 2), 4, num_blocks=4)


def test_tensor_without_a_block_dimension_is_refused():
    with pytest.raises(PlanError, match="num_blocks=5"):
        tensor_segments(0, (4, 8), (8, 1), 4, num_blocks=5)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [
        ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),
        ([0, 2, 4, 6], [1, 3, 5, 7]),
        ([7, 1, 2, 9, 10, 11, 3], [0, 1, 2, 5, 6, 7, 12]),
    ],
)
def test_region_bytes_equal_the_sum_of_block_bytes(src_ids, dst_ids):
    src = [_seg(0, block_len=BLOCK), _seg(10_000, stride=128, block_len=96)]
    dst = [_seg(50_000, block_len=BLOCK), _seg(90_000, stride=96, block_len=96)]
    regions = plan_regions(src, dst, src_ids, dst_ids)
    assert sum(r.length for r in regions) == len(src_ids) * (BLOCK + 96)


@pytest.mark.parametrize(
    ("src", "dst", "src_ids", "dst_ids", "match"),
    [
        ([_seg(0)], [_seg(0), _seg(1000)], [0], [0], "1 remote segments vs 2 local"),
        ([_seg(0)], [_seg(0)], [0, 1], [0], "2 remote blocks vs 1 local"),
        ([_seg(0, block_len=32)], [_seg(0)], [0], [0], "block length 32"),
    ],
)
def test_mismatched_plans_are_refused(src, dst, src_ids, dst_ids, match):
    with pytest.raises(PlanError, match=match):
        plan_regions(src, dst, src_ids, dst_ids)
