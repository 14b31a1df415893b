"""Pool keys: the hash chain over token blocks, its salt, the TP rank, the partial tail, and what
else decides a block's KV (LoRA adapter, images, ``cache_salt``) as vLLM's prefix cache keys."""

from __future__ import annotations

import pytest

from mooncake_vllm.core.prompt_identity import PLAIN, MMSpan, PromptIdentity
from mooncake_vllm.pool.keys import (
    block_keys,
    chain_digests,
    key_rank,
    key_ranks,
    leading_hits,
    pool_key,
)

SALT = "s" * 64
BASE = list(range(10, 10 + 300))


@pytest.mark.parametrize(
    ("length", "block_size", "blocks"),
    [(0, 128, 0), (1, 128, 1), (127, 128, 1), (128, 128, 1), (129, 128, 2), (300, 128, 3),
     (300, 16, 19), (256, 128, 2)],
)  # fmt: skip
def test_one_digest_per_block_the_last_possibly_partial(length, block_size, blocks):
    assert len(chain_digests(BASE[:length], block_size, SALT)) == blocks


@pytest.mark.parametrize(
    ("a", "b", "same_blocks"),
    [
        # Same first block, different second: the first key is shared, the second not.
        (BASE[:256], BASE[:128] + [1] * 128, 1),
        # One token changed in block 0: no key shared (each key names the whole prefix).
        ([0, *BASE[1:256]], BASE[:256], 0),
        # A prompt and its extension share every full block of the shorter one.
        (BASE[:256], BASE[:300], 2),
        # Partial tails of different lengths over the same tokens differ.
        (BASE[:200], BASE[:201], 1),
        # A partial tail differs from the full block it would grow into.
        (BASE[:255], BASE[:256], 1),
        # Identical prompts share everything, the partial tail included.
        (BASE[:300], BASE[:300], 3),
    ],
)
def test_a_key_names_every_token_before_its_block_end(a, b, same_blocks):
    da, db = chain_digests(a, 128, SALT), chain_digests(b, 128, SALT)
    shared = 0
    for x, y in zip(da, db, strict=False):
        if x != y:
            break
        shared += 1
    assert shared == same_blocks
    assert da[shared:] == [] or not set(da[shared:]) & set(db)  # no later key collides either


def test_salt_separates_models_and_layouts():
    assert not set(chain_digests(BASE, 128, "a" * 64)) & set(chain_digests(BASE, 128, "b" * 64))


def test_block_size_is_part_of_the_chain():
    assert chain_digests(BASE[:256], 128, SALT)[0] != chain_digests(BASE[:256], 64, SALT)[1]


def test_rank_and_version_are_in_the_key():
    d = chain_digests(BASE, 128, SALT)[0]
    assert pool_key(d, 0) != pool_key(d, 1)
    assert pool_key(d, 1).startswith("mcv-pool/1/") and pool_key(d, 1).endswith("/1")
    assert block_keys([d, d], 3) == [pool_key(d, 3)] * 2


def test_digests_are_stable_across_runs():
    # A change here orphans every value in running pools: bump KEY_VERSION with it.
    assert [d[:16] for d in chain_digests([1, 2, 3], 2, "x")] == [
        "99c191f76fe41586",
        "8fe90c63e7fca51a",
    ]


def test_large_token_ids_are_hashed_not_truncated():
    assert chain_digests([2**40], 4, SALT) != chain_digests([0], 4, SALT)


@pytest.mark.parametrize(
    ("exists", "blocks", "tp", "hits"),
    [
        ([], 0, 1, 0),
        ([1, 1, 1], 3, 1, 3),
        ([1, 0, 1], 3, 1, 1),
        ([0, 1, 1], 3, 1, 0),
        ([1, -900, 1], 3, 1, 1),  # an error ends the run like a miss
        ([1, 1, 1, 0], 2, 2, 1),  # rank 1 lacks block 1
        ([1, 1, 1, 1], 2, 2, 2),
    ],
)
def test_leading_hits_need_every_rank(exists, blocks, tp, hits):
    assert leading_hits(exists, blocks, tp) == hits


def test_leading_hits_rejects_a_short_answer():
    with pytest.raises(ValueError, match="answers"):
        leading_hits([1], 2, 1)


@pytest.mark.parametrize(
    ("tp_size", "tp_rank", "replicated", "ranks", "rank"),
    [(1, 0, False, 1, 0), (2, 1, False, 2, 1), (2, 1, True, 1, 0), (4, 3, True, 1, 0)],
)
def test_kv_replicated_has_one_copy_under_rank_0(tp_size, tp_rank, replicated, ranks, rank):
    assert key_ranks(tp_size, replicated) == ranks
    assert key_rank(tp_rank, replicated) == rank


SQL = PromptIdentity(lora=("sql", "/adapters/sql"))
IMG_A = PromptIdentity(mm=(MMSpan("hash-a", 140, 100),))  # placeholder tokens 140..239: block 1
IMG_B = PromptIdentity(mm=(MMSpan("hash-b", 140, 100),))


@pytest.mark.parametrize(
    ("a", "b", "same_blocks"),
    [
        # Two adapters, or an adapter and none: no block's KV is the same.
        (SQL, PromptIdentity(lora=("chat", "/adapters/chat")), 0),
        (SQL, PromptIdentity(lora=("sql", "/adapters/sql-v2")), 0),  # a name re-pointed
        (SQL, PLAIN, 0),
        # Two tenants' salts, or a salt and none: only the first block hashes the salt, and
        # the chain carries it into every later key.
        (PromptIdentity(cache_salt="t1"), PromptIdentity(cache_salt="t2"), 0),
        (PromptIdentity(cache_salt="t1"), PLAIN, 0),
        # Two images behind the same placeholders: shared up to the block the image starts in.
        (IMG_A, IMG_B, 1),
        (IMG_A, PLAIN, 1),
        # The same image one token later.
        (IMG_A, PromptIdentity(mm=(MMSpan("hash-a", 141, 100),)), 1),
        # Equal identities share everything, the partial tail included.
        (SQL, PromptIdentity(lora=("sql", "/adapters/sql")), 3),
        (IMG_A, PromptIdentity(mm=(MMSpan("hash-a", 140, 100),)), 3),
    ],
)
def test_what_else_decides_the_kv_separates_keys_from_its_first_block_on(a, b, same_blocks):
    da, db = chain_digests(BASE, 128, SALT, a), chain_digests(BASE, 128, SALT, b)
    assert da[:same_blocks] == db[:same_blocks]
    assert not set(da[same_blocks:]) & set(db)


def test_a_plain_identity_keeps_todays_keys_so_running_pools_stay_valid():
    assert chain_digests(BASE, 128, SALT, PLAIN) == chain_digests(BASE, 128, SALT)
    # Blocks before an image are the plain prompt's blocks: a pool's text prefix still serves.
    assert chain_digests(BASE, 128, SALT, IMG_A)[0] == chain_digests(BASE, 128, SALT)[0]


def test_keys_with_an_identity_are_stable_across_runs():
    # A change here orphans every LoRA, image or salted value in running pools.
    ident = PromptIdentity(lora=("sql", "/a"), mm=(MMSpan("h", 1, 2),), cache_salt="t")
    assert [d[:16] for d in chain_digests([1, 2, 3], 2, "x", ident)] == [
        "f6198063622fa2b7",
        "734115f54cfd2d0b",
    ]
