"""Region planning: remote → local block copies merged into the fewest transfer-engine entries,
and KV layouts it must refuse."""

from __future__ import annotations

import pytest

from mooncake_vllm.core.planning import (
    PlanError,
    Region,
    plan_regions,
    producer_rank_for,
    tensor_segments,
)
from mooncake_vllm.p2p.protocol import (
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


# ---- MLA: one latent per token and layer, no K/V split --------------------------------------
# vLLM's CPU MLA backend caches kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token in
# blocks of 16 tokens. vLLM 0.32 hands the connector one [num_blocks, 1, 16, 576] float32 view per
# layer (logical [B, H, N, C], H = 1 for a latent), all layers carved from one buffer: layer after
# layer (layer-compact layouts; CPU MLA declares no preference, so LBNHC, the default) or block
# after block (block-outer layouts, e.g. BLNHC).

LATENT, MLA_TOKENS, F32 = 576, 16, 4
MLA_PAGE = MLA_TOKENS * LATENT  # elements per block of one layer
MLA_BLOCK_BYTES = MLA_PAGE * F32


def _mla_layer(num_blocks: int, layer: int = 0, layers: int = 1, block_outer: bool = False):
    """(data_ptr, shape, strides) of one layer's MLA view in a buffer at 0x100000, as vLLM's
    LBNHC (or, ``block_outer``, BLNHC) layout strides it: the size-1 head dimension gets the
    token stride."""
    shape = (num_blocks, 1, MLA_TOKENS, LATENT)
    if block_outer:  # block b of layer l at (b * layers + l) pages
        return 0x100000 + layer * MLA_BLOCK_BYTES, shape, (layers * MLA_PAGE, LATENT, LATENT, 1)
    start = 0x100000 + layer * num_blocks * MLA_BLOCK_BYTES
    return start, shape, (MLA_PAGE, LATENT, LATENT, 1)


@pytest.mark.parametrize(
    ("tensor", "num_blocks", "expected"),
    [
        pytest.param(
            _mla_layer(8), 8, MemSegment(0x100000, MLA_BLOCK_BYTES, MLA_BLOCK_BYTES), id="view"
        ),
        pytest.param(
            (0x100000, (8, 1, MLA_TOKENS, LATENT), (MLA_PAGE, MLA_PAGE, LATENT, 1)),
            8,
            MemSegment(0x100000, MLA_BLOCK_BYTES, MLA_BLOCK_BYTES),
            id="LBHNC-view",
        ),
        pytest.param(
            (0x100000, (8, MLA_TOKENS, LATENT), (MLA_PAGE, LATENT, 1)),
            8,
            MemSegment(0x100000, MLA_BLOCK_BYTES, MLA_BLOCK_BYTES),
            id="3d-without-head-dim",
        ),
        # The block count may equal the tokens per block or the latent width: the block dimension
        # is still the first one.
        pytest.param(
            _mla_layer(16), 16, MemSegment(0x100000, MLA_BLOCK_BYTES, MLA_BLOCK_BYTES), id="16"
        ),
        pytest.param(
            _mla_layer(576), 576, MemSegment(0x100000, MLA_BLOCK_BYTES, MLA_BLOCK_BYTES), id="576"
        ),
        pytest.param(
            _mla_layer(8, layer=1, layers=2),
            8,
            MemSegment(0x100000 + 8 * MLA_BLOCK_BYTES, MLA_BLOCK_BYTES, MLA_BLOCK_BYTES),
            id="second-layer",
        ),
        pytest.param(
            _mla_layer(8, layer=1, layers=2, block_outer=True),
            8,
            MemSegment(0x100000 + MLA_BLOCK_BYTES, 2 * MLA_BLOCK_BYTES, MLA_BLOCK_BYTES),
            id="block-outer",
        ),
    ],
)
def test_an_mla_layer_is_one_segment_of_latent_blocks(tensor, num_blocks, expected):
    data_ptr, shape, strides = tensor
    assert tensor_segments(data_ptr, shape, strides, F32, num_blocks) == [expected]


@pytest.mark.parametrize(
    ("block_outer", "expected_offsets"),
    [
        # layer-compact: a run of blocks is one range per layer
        (False, [(3, 0, 3)]),
        # block-outer: the other layer's page sits between two blocks, nothing merges
        (True, [(3, 0, 1), (4, 1, 1), (5, 2, 1)]),
    ],
)
def test_mla_regions_merge_only_where_a_layers_blocks_are_adjacent(block_outer, expected_offsets):
    num_blocks, layers = 8, 2
    segments = []
    for layer in range(layers):
        data_ptr, shape, strides = _mla_layer(num_blocks, layer, layers, block_outer)
        segments += tensor_segments(data_ptr, shape, strides, F32, num_blocks)
    dst = [MemSegment(s.base_addr + 0x10000000, s.block_stride, s.block_len) for s in segments]
    regions = plan_regions(segments, dst, [3, 4, 5], [0, 1, 2])
    expected = [
        Region(
            s.base_addr + src_block * s.block_stride,
            d.base_addr + dst_block * d.block_stride,
            n * MLA_BLOCK_BYTES,
        )
        for s, d in zip(segments, dst, strict=True)
        for src_block, dst_block, n in expected_offsets
    ]
    assert regions == expected
    assert sum(r.length for r in regions) == 3 * layers * MLA_BLOCK_BYTES


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_mla_views_from_vllms_own_allocator_plan_as_one_latent_segment_per_layer(layout):
    # The tensors vLLM's allocation code makes for the tiny MLA model's KV cache spec (what
    # register_kv_caches receives), read by the planner exactly as the worker reads them.
    import torch
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    num_blocks, layers = 10, 2
    spec = MLAAttentionSpec(
        block_size=MLA_TOKENS, num_kv_heads=1, head_size=LATENT, dtype=torch.float32
    )
    assert spec.page_size_bytes == MLA_BLOCK_BYTES
    kv_layout = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, kv_layout)
    size = layers * num_blocks * MLA_BLOCK_BYTES
    placement = KVCacheTensor(
        size=size, layers=["l0", "l1"], layer_stride=layer_stride, block_stride=block_stride
    )
    buf = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(buf, spec, num_blocks, kv_layout, placement)
    base = buf.data_ptr()
    segments = [
        s
        for v in views
        for s in tensor_segments(v.data_ptr(), v.shape, v.stride(), v.element_size(), num_blocks)
    ]
    assert [tuple(v.shape) for v in views] == [(num_blocks, 1, MLA_TOKENS, LATENT)] * layers
    assert {v.dtype for v in views} == {torch.float32}
    if kv_layout.is_layer_compact:
        assert segments == [
            MemSegment(base + i * num_blocks * MLA_BLOCK_BYTES, MLA_BLOCK_BYTES, MLA_BLOCK_BYTES)
            for i in range(layers)
        ]
    else:
        assert segments == [
            MemSegment(base + i * MLA_BLOCK_BYTES, layers * MLA_BLOCK_BYTES, MLA_BLOCK_BYTES)
            for i in range(layers)
        ]


def test_a_per_head_kv_layer_never_plans_against_an_mla_layer():
    # A 2-layer Llama (blocks of 16 tokens, K and V of 4 heads x 64) against the 2-layer MLA model:
    # same segment count, other block length. The compat hash refuses such a pair first; the plan
    # refuses it too rather than copying latent bytes into K/V blocks.
    kv_block = 2 * 4 * MLA_TOKENS * 64  # elements
    kv = [MemSegment(i * 0x1000000, kv_block * F32, kv_block * F32) for i in range(2)]
    mla = [tensor_segments(*_mla_layer(8, layer, 2), F32, 8)[0] for layer in range(2)]
    with pytest.raises(PlanError, match="block length"):
        plan_regions(kv, mla, [0], [0])


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


# ---- which producer rank a consumer rank pulls from ------------------------------------------


@pytest.mark.parametrize(
    ("consumer_tp", "producer_tp", "expected"),
    [
        (1, 1, [0]),
        (2, 2, [0, 1]),  # each decode rank reads the latent once, from one prefill rank
        (1, 2, [0]),  # prefill TP2 -> decode TP1: prefill rank 1 is not read
        (2, 1, [0, 0]),  # prefill TP1 -> decode TP2: both decode ranks read rank 0
        (4, 2, [0, 1, 0, 1]),  # spread over the producer ranks
        (2, 4, [0, 1]),
    ],
)
def test_an_mla_consumer_rank_pulls_the_replicated_latent_from_one_producer_rank(
    consumer_tp, producer_tp, expected
):
    ranks = [producer_rank_for(r, consumer_tp, producer_tp, True) for r in range(consumer_tp)]
    assert ranks == expected


def test_per_head_kv_is_pulled_rank_to_rank_and_needs_equal_tp_sizes():
    assert [producer_rank_for(r, 2, 2, False) for r in range(2)] == [0, 1]
    for consumer_tp, producer_tp in ((1, 2), (2, 1)):
        with pytest.raises(PlanError, match="per-head K/V is sharded"):
            producer_rank_for(0, consumer_tp, producer_tp, False)


@pytest.mark.parametrize(("rank", "consumer_tp", "producer_tp"), [(2, 2, 2), (-1, 2, 2), (0, 1, 0)])
def test_rank_selection_refuses_impossible_ranks(rank, consumer_tp, producer_tp):
    with pytest.raises(PlanError):
        producer_rank_for(rank, consumer_tp, producer_tp, True)
