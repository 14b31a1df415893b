"""Content addressing: pool keys from a prompt's token blocks.

A prompt is cut into blocks of ``block_size`` tokens, the last one possibly partial. Block ``i``'s
digest hashes the digest of block ``i - 1`` with block ``i``'s tokens, so it names the whole
prefix up to the block's end: two prompts share a key exactly when they share every token up to
there. The chain starts from the *salt* (the compat hash: model, dtype, KV layout, block size, TP
size), so two models or layouts never address each other's KV; the key adds the TP rank, since
each rank stores its own heads. An MLA latent is the same on every rank (replicated, not sharded),
so an MLA engine stores it once, under rank 0, and every rank of any TP size reads that one copy.
A partial block hashes its token count with its tokens: a
prompt's 70-token tail and another's 100-token tail with the same first 70 tokens differ.

What else decides a block's KV is hashed after its tokens, as vLLM's prefix cache does
(``core.prompt_identity.block_extra_keys``): the LoRA adapter (name and path) on every block,
the multimodal inputs overlapping the block, the request's ``cache_salt`` on the first block
(and so, through the chain, on every later one). A block with none of these hashes exactly as
before they were added, so a plain prompt's keys, and the values a running pool holds under
them, are unchanged and ``KEY_VERSION`` stays. A block with any of them hashes more bytes than a
plain block of the same token count, so the two never collide. A pool that served LoRA,
multimodal or salted requests before this holds their KV under plain keys: restart its master
when upgrading.

A hybrid model (vLLM's hybrid allocator: a KV cache group per kind of attention,
``core.kv_groups``) stores each group's block under its own key, ``.../g<group>/<rank>``, whose
value is that block of the group's layers: a sliding-window group's blocks are put as they are
computed, and a load gets only those vLLM allocates (the window's), so a decode pulls a window, not
the prompt. A model of one group keeps the keys it had.

The key string carries ``KEY_VERSION``: a change of the value's layout bumps it, and old values
in a running pool are simply never found.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from mooncake_vllm.core.prompt_identity import PLAIN, PromptIdentity, block_extra_keys

KEY_VERSION = 1
_PREFIX = f"mcv-pool/{KEY_VERSION}"


def chain_digests(
    token_ids: Sequence[int], block_size: int, salt: str, identity: PromptIdentity = PLAIN
) -> list[str]:
    """One hex digest per block of ``token_ids`` (the last block may be partial), each also
    covering what ``identity`` adds to that block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = hashlib.sha256(f"{_PREFIX}/{salt}".encode()).digest()
    out = []
    for start in range(0, len(token_ids), block_size):
        chunk = token_ids[start : start + block_size]
        h = hashlib.sha256(prev)
        h.update(len(chunk).to_bytes(4, "little"))
        h.update(array("q", chunk).tobytes())
        extra = block_extra_keys(identity, start, start + len(chunk))
        if extra:
            h.update(len(extra).to_bytes(4, "little"))
            h.update(extra)
        prev = h.digest()
        out.append(prev.hex())
    return out


def pool_key(digest: str, tp_rank: int, group: int | None = None) -> str:
    """The store key of one block's KV on one TP rank; ``group``: the KV cache group of a hybrid
    model (None for a model of one group, whose keys stay as they were before groups)."""
    if group is None:
        return f"{_PREFIX}/{digest}/{tp_rank}"
    return f"{_PREFIX}/{digest}/g{group}/{tp_rank}"


def key_ranks(tp_size: int, replicated: bool) -> int:
    """How many per-rank copies of a block the pool holds for an engine of ``tp_size`` ranks."""
    return 1 if replicated else tp_size


def key_rank(tp_rank: int, replicated: bool) -> int:
    """The rank under whose key a worker puts and gets its blocks."""
    return 0 if replicated else tp_rank


def block_keys(digests: Sequence[str], tp_rank: int, group: int | None = None) -> list[str]:
    return [pool_key(d, tp_rank, group) for d in digests]


def group_key(group: int, num_groups: int) -> int | None:
    """What a key names of a block's KV cache group: nothing for a model of one group."""
    return group if num_groups > 1 else None


def leading_hits(exists: Sequence[int], num_blocks: int, tp_size: int) -> int:
    """How many leading blocks every rank holds, from ``batch_is_exist`` results laid out
    rank-major (rank 0's ``num_blocks`` answers, then rank 1's, ...). 1 = present; 0 absent,
    negative = error: both end the run."""
    if len(exists) != num_blocks * tp_size:
        raise ValueError(f"{len(exists)} answers for {num_blocks} blocks × {tp_size} ranks")
    for i in range(num_blocks):
        if any(exists[r * num_blocks + i] != 1 for r in range(tp_size)):
            return i
    return num_blocks
