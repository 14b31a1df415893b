"""A hybrid model's KV cache groups (``core.kv_groups``): what a pull fills per group, what it
takes from the producer, and the sliding-window block the producer keeps past its request. No
vLLM engine: blocks and the block pool are stubs with vLLM's attribute names."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from mooncake_vllm.core.kv_groups import (
    NULL_BLOCK_ID,
    GroupError,
    KVGroup,
    WindowKeeper,
    claim_hold_back,
    first_attended,
    group_segments,
    positions_to_fill,
    trim_to_remote,
)

FULL = KVGroup(("layers.2",))
SLIDING = KVGroup(("layers.0", "layers.1"), sliding_window=128)
BS = 128


def block(block_id, cached=False, null=False):
    return NS(block_id=block_id, block_hash=b"h" if cached else None, is_null=null)


def test_only_a_model_with_a_sliding_window_holds_back_the_last_prompt_token():
    assert claim_hold_back([FULL]) == 0
    assert claim_hold_back([FULL, SLIDING]) == 1
    assert claim_hold_back([SLIDING]) == 1


def test_a_full_group_fills_every_block_after_the_local_prefix_cache():
    blocks = [block(7, cached=True), block(8), block(9)]
    assert positions_to_fill(blocks, FULL, 300, BS) == (1, [8, 9])
    with pytest.raises(GroupError, match="1 blocks before the load, 0 of them cached"):
        positions_to_fill([block(0, null=True), block(8), block(9)], FULL, 300, BS)


def test_a_sliding_group_fills_what_vllm_allocated_and_must_be_contiguous():
    blocks = [block(0, null=True), block(5), block(6)]
    assert positions_to_fill(blocks, SLIDING, 300, BS) == (1, [5, 6])
    holes = [block(4), block(0, null=True), block(6)]
    with pytest.raises(GroupError, match="not contiguous"):
        positions_to_fill(holes, SLIDING, 300, BS)
    # Blocks beyond the load's last (vLLM's lookahead) are not the load's.
    assert positions_to_fill([*blocks, block(9)], SLIDING, 256, BS) == (1, [5])


def test_the_first_attended_block_is_that_of_the_computed_tokens_window():
    # After a load of 254 tokens the decode computes token 254, whose window starts at 127.
    assert first_attended(SLIDING, 254, BS) == 0
    assert first_attended(SLIDING, 255, BS) == 1
    assert first_attended(SLIDING, 100, BS) == 0
    assert first_attended(FULL, 1000, BS) == 0


def test_leading_blocks_the_producer_freed_and_the_decode_never_reads_are_dropped():
    # 600 tokens loaded: the window of token 600 starts at 473, block 3.
    remote = [NULL_BLOCK_ID, NULL_BLOCK_ID, 30, 31, 32]
    assert trim_to_remote(0, SLIDING, remote, [10, 11, 12, 13, 14], 0, 600, BS) == (
        [12, 13, 14],
        256,
    )
    assert trim_to_remote(0, SLIDING, [0, 0, 0, 31, 32], [13, 14], 384, 600, BS) == ([13, 14], 384)


def test_a_freed_block_the_decode_reads_fails_the_pull_naming_it():
    with pytest.raises(GroupError, match=r"freed blocks 3\.\.3 .* that tokens 384\.\.600 need"):
        trim_to_remote(2, SLIDING, [0, 0, 0, 0, 32], [13, 14], 384, 600, BS)
    with pytest.raises(GroupError, match=r"freed blocks 1\.\.1"):
        trim_to_remote(1, FULL, [5, 0, 7], [1, 2, 3], 0, 300, BS)
    with pytest.raises(GroupError, match="lists 2 blocks, tokens up to 300 need 3"):
        trim_to_remote(1, FULL, [5, 6], [1, 2, 3], 0, 300, BS)


def test_each_group_reads_its_own_layers_segments():
    owners = ["layers.0", "layers.0", "layers.1", "layers.2"]  # layer 0: K and V segments
    assert group_segments([SLIDING, FULL], owners) == [[0, 1, 2], [3]]
    assert group_segments([KVGroup(())], owners) == [[0, 1, 2, 3]]
    with pytest.raises(GroupError, match=r"layers\.2 has a KV cache but is in no"):
        group_segments([SLIDING], owners)
    with pytest.raises(GroupError, match="in KV cache groups 0 and 1"):
        group_segments([SLIDING, SLIDING], owners[:3])


class Pool:
    """vLLM's ``BlockPool`` as the keeper uses it: blocks by id, touch and free."""

    def __init__(self, n):
        self.blocks = [
            NS(block_id=i, ref_cnt=0 if i else 1, is_null=i == 0, block_hash=None) for i in range(n)
        ]
        self.freed = []

    def touch(self, blocks):
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks):
        for b in blocks:
            b.ref_cnt -= 1
            self.freed.append(b.block_id)


def key(h: bytes, group: int) -> bytes:
    return h + group.to_bytes(4, "big")


def test_the_producer_keeps_the_freed_block_the_decodes_first_token_attends_to():
    pool = Pool(20)
    keeper = WindowKeeper([SLIDING, FULL], BS)
    keeper.bind(pool)
    keeper.track("r", [[11, 12], [13, 14]], new=True)
    # 255 tokens: the decode computes token 254 again, whose window starts at token 127.
    request = NS(request_id="r", num_prompt_tokens=255, block_hashes=[b"a", b"b"])
    pool.blocks[11].block_hash = key(b"a", 0)  # freed by vLLM just before request_finished
    handed = [[NULL_BLOCK_ID, 12], [13, 14]]
    keeper.keep(request, handed)
    assert handed == [[11, 12], [13, 14]]
    assert pool.blocks[11].ref_cnt == 1
    keeper.release(["r"])
    assert pool.freed == [11] and pool.blocks[11].ref_cnt == 0
    keeper.release(["r"])  # once only
    assert pool.freed == [11]


@pytest.mark.parametrize(
    "why, change",
    [
        ("used again: another prompt's", lambda b: setattr(b, "block_hash", key(b"x", 0))),
        ("another group's, same tokens", lambda b: setattr(b, "block_hash", key(b"a", 1))),
        ("no hash (prefix caching off)", lambda b: setattr(b, "block_hash", None)),
        ("in use by another request", lambda b: setattr(b, "ref_cnt", 1)),
    ],
)  # fmt: skip
def test_a_block_that_may_hold_other_kv_is_never_handed_over(why, change):
    pool = Pool(20)
    keeper = WindowKeeper([SLIDING, FULL], BS)
    keeper.bind(pool)
    keeper.track("r", [[11], [13]], new=True)
    keeper.track("r", [[12], [14]], new=False)
    pool.blocks[11].block_hash = key(b"a", 0)
    change(pool.blocks[11])
    handed = [[NULL_BLOCK_ID, 12], [13, 14]]
    keeper.keep(NS(request_id="r", num_prompt_tokens=255, block_hashes=[b"a", b"b"]), handed)
    assert handed[0][0] == NULL_BLOCK_ID, why
    keeper.release(["r"])
    assert pool.freed == []


def test_a_full_attention_model_keeps_nothing():
    keeper = WindowKeeper([FULL], BS)
    assert not keeper.active
