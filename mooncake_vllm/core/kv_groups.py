"""The KV cache groups of a hybrid model, as vLLM's hybrid memory allocator (HMA) keeps them.

A model that mixes kinds of attention (Gemma 3, gpt-oss, Cohere 2: sliding-window and
full-attention layers) gets one KV cache group per kind, each with a block table of its own: a
request's block ``i`` of group ``g`` holds tokens ``[i * block_size, (i + 1) * block_size)`` of
that group's layers. A full-attention group keeps every block of the prompt; a sliding-window
group keeps only the blocks its window can still reach, the others replaced by vLLM's null
block (id 0, never a real block).

What moves in a handover is decided here, per group: every block vLLM allocated for the
consumer's request that the local prefix cache does not hold. For a sliding-window group vLLM
allocates only the blocks the window of the first token to compute can reach (the earlier ones
are null), so only those move. A model with a sliding-window group is claimed one prompt token
short (``claim_hold_back``): vLLM decides which blocks a window skips from the tokens loaded,
and with every prompt token loaded it would skip the block holding the oldest token that the
last prompt token, which it recomputes after any load, still attends to. No vLLM import at module
level: the tests drive this with stubs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

NULL_BLOCK_ID = 0  # vLLM's BlockPool: the first block is the null block


class GroupError(ValueError):
    """A model's KV cache groups, or one request's blocks in them, that we cannot move."""


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers (by name) and its sliding window in tokens (0: full
    attention, every block of the prompt is kept)."""

    layer_names: tuple[str, ...]
    sliding_window: int = 0

    def describe(self) -> str:
        return f"sliding window {self.sliding_window}" if self.sliding_window else "full attention"


def kv_groups(kv_cache_config: Any) -> tuple[KVGroup, ...]:
    """The groups of vLLM's ``KVCacheConfig`` (None: one full-attention group of every layer);
    raises GroupError for a group whose state we cannot move (Mamba or linear-attention state,
    chunked local attention, cross attention, groups of mixed specs, groups left out of KV
    transfer), naming it."""
    if kv_cache_config is None:
        return (KVGroup(()),)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not getattr(group, "enable_kv_transfer", True):
            raise GroupError(f"KV cache group {g} is left out of KV transfer by vLLM")
        if type(spec) is SlidingWindowSpec:
            groups.append(KVGroup(tuple(group.layer_names), int(spec.sliding_window)))
        elif isinstance(spec, FullAttentionSpec):
            groups.append(KVGroup(tuple(group.layer_names)))
        else:
            raise GroupError(
                f"KV cache group {g} ({len(group.layer_names)} layers) is "
                f"{type(spec).__name__}: only full-attention and sliding-window KV are moved"
            )
    return tuple(groups)


def claim_hold_back(groups: Sequence[KVGroup]) -> int:
    """The prompt tokens a consumer leaves out of its external load: 1 with a sliding-window
    group (the last prompt token, computed locally, as vLLM does after any load anyway), else
    0. Measured: Gemma 3 with a 128-token window and 128-token blocks, a 255-token prompt
    claimed whole: vLLM allocates no block 0 in the sliding groups, the recompute of token 254
    reads token 127 from the null block, and the decode's 4th token differs from a plain
    vLLM's."""
    return 1 if any(g.sliding_window for g in groups) else 0


def group_segments(groups: Sequence[KVGroup], owners: Sequence[str]) -> list[list[int]]:
    """Per group, the indices of the segments of its layers (``owners``: each segment's layer,
    ``planning.kv_cache_regions``); a group that names no layers (no ``KVCacheConfig``) has
    them all. Raises GroupError for a layer of no group or of two."""
    if len(groups) == 1 and not groups[0].layer_names:
        return [list(range(len(owners)))]
    group_of: dict[str, int] = {}
    for g, group in enumerate(groups):
        for name in group.layer_names:
            if name in group_of:
                raise GroupError(f"layer {name} is in KV cache groups {group_of[name]} and {g}")
            group_of[name] = g
    picks: list[list[int]] = [[] for _ in groups]
    for i, name in enumerate(owners):
        if name not in group_of:
            raise GroupError(f"layer {name} has a KV cache but is in no KV cache group")
        picks[group_of[name]].append(i)
    return picks


def positions_to_fill(
    blocks: Sequence[Any], group: KVGroup, end_token: int, block_size: int
) -> tuple[int, list[int]]:
    """The consumer's blocks of one group that a pull of tokens ``[0, end_token)`` fills:
    ``(first block index, block ids)``, contiguous up to the last block of ``end_token``.
    ``blocks`` are vLLM's ``KVCacheBlock``s of the request in that group
    (``KVCacheBlocks.blocks[g]``, index = block position): those with a hash are the local
    prefix cache's, null ones vLLM did not allocate (skipped by a window). Raises GroupError
    where the blocks are not that shape."""
    n = -(-end_token // block_size)
    positions = [
        i
        for i, b in enumerate(blocks[:n])
        if b.block_hash is None and not getattr(b, "is_null", False)
    ]
    if not positions:
        return n, []
    first = positions[0]
    if positions != list(range(first, n)):
        raise GroupError(
            f"{group.describe()}: blocks {positions[0]}..{positions[-1]} to fill are not "
            f"contiguous up to the load's last block {n - 1}"
        )
    if not group.sliding_window:
        cached = sum(1 for b in blocks[:first] if b.block_hash is not None)
        if cached != first:
            raise GroupError(f"{first} blocks before the load, {cached} of them cached")
    return first, [blocks[i].block_id for i in positions]


def first_attended(group: KVGroup, end_token: int, block_size: int) -> int:
    """The first block a decode after a load of ``[0, end_token)`` reads in ``group``: the
    window of token ``end_token`` (the first it computes) reaches back to ``end_token -
    sliding_window + 1``; 0 for full attention."""
    if not group.sliding_window:
        return 0
    return max(0, end_token - group.sliding_window + 1) // block_size


def trim_to_remote(
    group: int,
    kv_group: KVGroup,
    remote_block_ids: Sequence[int],
    local_block_ids: list[int],
    first_token: int,
    end_token: int,
    block_size: int,
) -> tuple[list[int], int]:
    """``(local_block_ids, first_token)`` without the leading blocks the producer no longer
    has (its window freed them: the null block) and the decode never reads; raises GroupError
    if a block it reads is missing at the producer."""
    n = -(-end_token // block_size)
    if len(remote_block_ids) < n:
        raise GroupError(
            f"KV cache group {group}: the producer lists {len(remote_block_ids)} blocks, "
            f"tokens up to {end_token} need {n}"
        )
    first = first_token // block_size
    needed = first_attended(kv_group, end_token, block_size)
    while first < needed and local_block_ids and remote_block_ids[first] == NULL_BLOCK_ID:
        first, local_block_ids = first + 1, local_block_ids[1:]
    freed = [i for i in range(first, n) if remote_block_ids[i] == NULL_BLOCK_ID]
    if freed:
        raise GroupError(
            f"KV cache group {group}: the producer had freed blocks {freed[0]}..{freed[-1]} "
            f"(outside its sliding window) that tokens {first * block_size}..{end_token} need"
        )
    return local_block_ids, first * block_size


class WindowKeeper:
    """Producer: keeps, past its request, the one block of each sliding-window group that a
    consumer's first computed token still attends to but vLLM frees before it calls
    ``request_finished``.

    vLLM frees a finished request's out-of-window blocks on the basis of its next token (at
    position ``prompt_len``), whose window starts at ``prompt_len - sliding_window + 1``. The
    decode computes the last prompt token again (``claim_hold_back``), whose window starts one
    token earlier: where that token begins a block, the block is gone from the handoff (the
    null block). This keeper remembers each handed-over request's blocks as vLLM schedules
    them (``track``), and when the request finishes takes that block back from the free
    queue with an extra reference (``keep``: vLLM allocates nothing between the free and the
    hook, so its content is intact) and puts its id back in the handoff; ``release`` frees it
    once the lease has ended."""

    def __init__(self, groups: Sequence[KVGroup], block_size: int):
        self._sliding = [g for g, group in enumerate(groups) if group.sliding_window]
        self._groups, self._block_size = groups, block_size
        self._pool: Any = None
        self._seen: dict[str, list[list[int]]] = {}  # request → its blocks per group, so far
        self._kept: dict[str, list[Any]] = {}  # request → blocks held for its lease

    @property
    def active(self) -> bool:
        return bool(self._sliding)

    def bind(self, pool: Any) -> None:
        self._pool = pool

    def track(self, req_id: str, block_ids: Sequence[Sequence[int]] | None, new: bool) -> None:
        """``block_ids``: the request's blocks per group this step gave it (all of them for a
        new request, the new ones for a running one)."""
        if block_ids is None:
            return
        if new:
            self._seen[req_id] = [list(ids) for ids in block_ids]
        elif (seen := self._seen.get(req_id)) is not None:
            for have, more in zip(seen, block_ids, strict=False):
                have.extend(more)

    def forget(self, req_id: str) -> None:
        self._seen.pop(req_id, None)

    def keep(self, request: Any, groups: list[list[int]]) -> None:
        """Put back in ``groups`` (each group's prompt blocks, changed in place) the freed block
        the consumer's first token attends to, holding it until ``release``. Only a block that
        still holds that group's KV of this prompt's block (its prefix-cache hash and group id
        say so: a block freed earlier may have been used again since) is taken."""
        req_id = request.request_id
        seen = self._seen.pop(req_id, None)
        if seen is None or self._pool is None:
            return
        hashes = getattr(request, "block_hashes", None) or []
        kept = []
        for g in self._sliding:
            j = first_attended(self._groups[g], request.num_prompt_tokens - 1, self._block_size)
            if not (j < len(groups[g]) and groups[g][j] == NULL_BLOCK_ID and j < len(seen[g])):
                continue
            block = self._pool.blocks[seen[g][j]]
            key = block.block_hash
            if (
                block.ref_cnt == 0
                and not block.is_null
                and key is not None
                and j < len(hashes)
                and bytes(key[:-4]) == bytes(hashes[j])
                and int.from_bytes(key[-4:], "big") == g
            ):
                self._pool.touch([block])
                kept.append(block)
                groups[g][j] = block.block_id
        if kept:
            self._kept[req_id] = kept

    def release(self, req_ids: Iterable[str]) -> None:
        """The leases of ``req_ids`` ended (or never began): free what was kept for them."""
        for req_id in req_ids:
            if (kept := self._kept.pop(req_id, None)) is not None:
                self._pool.free_blocks(kept)
