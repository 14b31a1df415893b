"""Pure block → memory-region math for a pull, for any producer and consumer layout.

A KV cache tensor is seen as one or more *segments*: runs of equally sized blocks at a fixed stride
(e.g. a ``(2, num_blocks, ...)`` layer tensor gives a K segment and a V segment; a block-first view
such as CPU attention's ``(num_blocks, heads, block_size, 2 * head_size)`` or an MLA layer's
``(num_blocks, block_size, latent)`` gives one). Each segment also says where one (head, token)
*unit* lives inside a block, read from the tensor's own shape and strides, so any layout vLLM
allocates is planned as it is.

Each side declares only itself: its TP size and rank, the model's KV heads, its block size and its
segments. From that, ``head_sources`` says which producer rank a consumer rank reads each of its
heads from (nothing is read twice; replicas are spread over producer ranks), ``lease_readers``
which consumer ranks acquire each producer rank's lease, and ``plan_pull`` turns (heads, prompt
tokens, remote blocks, local blocks) into byte regions. Equal block sizes and equal head sets copy
whole blocks (``plan_regions``); other head sets copy each needed head's slab of every block;
where tokens are byte ranges (``tokens_addressable``), other block sizes copy exactly the needed
heads and tokens. Consecutive copies that are contiguous on both sides are merged.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

# The KV format (``vllm_glue.kv_format``) of vLLM's CPU attention with its vec kernels: the one
# whose blocks ``core.reblock`` re-blocks between block sizes.
REBLOCKABLE = "cpu-vec"


class Region(NamedTuple):
    src_addr: int
    dst_addr: int
    length: int


class PlanError(ValueError):
    pass


class MemSegment(msgspec.Struct, frozen=True, array_like=True):
    """Where block ``b`` of one KV region lives: ``base_addr + b * block_stride``; and inside it,
    (local head ``h``, token slot ``t``) at ``h * head_stride + t * token_stride``, ``unit_len``
    contiguous bytes (``unit_len`` 0: the interior is not described, whole blocks only)."""

    base_addr: int
    block_stride: int
    block_len: int
    heads: int = 1
    tokens: int = 0
    head_stride: int = 0
    token_stride: int = 0
    unit_len: int = 0

    @property
    def interior(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.block_len,
            self.heads,
            self.tokens,
            self.head_stride,
            self.token_stride,
            self.unit_len,
        )


def kv_cache_regions(
    kv_caches,
    num_blocks: int,
    block_size: int | None = None,
    heads: int | None = None,
    tokens_addressable: bool = True,
    owners: list[str] | None = None,
) -> tuple[list[MemSegment], dict[int, tuple]]:
    """Every layer's KV tensor (``name → tensor``, enumerated by name, as every engine does) as
    memory segments, and the distinct storages behind them (``address → (bytes, a tensor on
    it)``), which is what a transfer engine registers. ``block_size`` and ``heads`` (KV heads
    on this rank) describe each block's interior (``tensor_segments``). ``owners``, if given,
    gets each segment's layer name (a hybrid model's groups read their own layers')."""
    segments: list[MemSegment] = []
    storages: dict[int, tuple] = {}
    for name in sorted(kv_caches):
        t = kv_caches[name]
        args = (t.data_ptr(), tuple(t.shape), t.stride(), t.element_size(), num_blocks)
        try:
            more = tensor_segments(
                *args, block_size=block_size, heads=heads, tokens_addressable=tokens_addressable
            )
        except PlanError:  # no token or head dimension found: whole-block copies only
            more = tensor_segments(*args)
        segments += more
        if owners is not None:
            owners += [name] * len(more)
        st = t.untyped_storage()
        storages[st.data_ptr()] = (st.nbytes(), t)
    return segments, storages


def tensor_segments(
    data_ptr: int,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    num_blocks: int,
    *,
    block_size: int | None = None,
    heads: int | None = None,
    tokens_addressable: bool = True,
) -> list[MemSegment]:
    """Segments of one KV tensor whose block dimension is the first of size ``num_blocks``.

    Dimensions after the block dimension must be contiguous (one block = one byte range). With
    ``block_size`` (and ``heads``, this rank's KV heads), the token and head dimensions inside a
    block are found by size and the unit after them must be contiguous; a block without a head
    dimension (an MLA latent) has one head. ``tokens_addressable`` false: the backend keeps a
    head's tokens in a format of its own (vLLM's CPU attention stores K column-major), so heads
    must be the outermost dimension and only whole head slabs are described; true: a block whose
    heads and tokens have the same size is refused (its shape cannot tell them apart).
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
    interior = (
        _interior(shape[d + 1 :], strides[d + 1 :], itemsize, block_size, heads, tokens_addressable)
        if block_size
        else ()
    )
    segments = []
    for outer in itertools.product(*(range(n) for n in shape[:d])):
        offset = sum(i * s for i, s in zip(outer, strides[:d], strict=True)) * itemsize
        segments.append(MemSegment(data_ptr + offset, block_stride, block_len, *interior))
    return segments


def _interior(
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    block_size: int,
    heads: int | None,
    tokens_addressable: bool,
) -> tuple[int, int, int, int, int]:
    """(heads, tokens, head_stride, token_stride, unit_len) of one block's dimensions. Not
    ``tokens_addressable``: below the head dimension, which must be outermost, the attention
    backend keeps its own format; the unit is a head's whole slab of the block."""
    dims = list(shape)
    if block_size not in dims:
        raise PlanError(f"no token dimension of size block_size={block_size} in a block {shape}")
    head_dim = None
    if heads is not None and heads > 1:
        if heads not in dims:
            raise PlanError(f"no head dimension of size {heads} in a block {shape}")
        head_dim = dims.index(heads)
        if tokens_addressable and heads == block_size:
            raise PlanError(f"heads and tokens both {heads}: which is which in {shape} is unknown")
    head_stride = strides[head_dim] * itemsize if head_dim is not None else 0
    if not tokens_addressable:
        if head_dim not in (None, 0):
            raise PlanError(f"heads are not the outermost dimension of a block {shape}")
        slab = math.prod(dims[1:] if head_dim == 0 else dims) * itemsize
        return (heads or 1, block_size, head_stride, 0, slab)
    token_dim = next(i for i, n in enumerate(dims) if n == block_size and i != head_dim)
    after = max(token_dim, head_dim if head_dim is not None else -1) + 1
    unit_len = math.prod(dims[after:]) * itemsize
    return (heads or 1, block_size, head_stride, strides[token_dim] * itemsize, unit_len)


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
            append_region(
                regions, s.base_addr + rb * s.block_stride, d.base_addr + lb * d.block_stride,
                s.block_len,
            )  # fmt: skip
    return regions


def rank_heads(total_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads (model-wide ids) TP rank ``rank`` holds, as vLLM shards them: an equal
    contiguous share when there are at least as many heads as ranks, else one head each,
    replicated over ``tp_size / total_heads`` ranks (an MLA latent is one head on every rank)."""
    if not 0 <= rank < tp_size:
        raise PlanError(f"TP rank {rank} outside TP size {tp_size}")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise PlanError(f"{total_heads} KV heads do not split over TP size {tp_size}")
        n = total_heads // tp_size
        return range(rank * n, rank * n + n)
    if tp_size % total_heads:
        raise PlanError(f"TP size {tp_size} is not a multiple of {total_heads} KV heads")
    h = rank * total_heads // tp_size
    return range(h, h + 1)


def head_sources(
    total_heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int
) -> dict[int, int]:
    """For each head consumer rank ``consumer_rank`` holds: the producer rank it reads it from.

    A head held by several producer ranks (replicas) is read from the nearest one, the producer
    rank at the same relative position, else spread over its holders by consumer rank."""
    near = consumer_rank * producer_tp // consumer_tp
    out: dict[int, int] = {}
    for h in rank_heads(total_heads, consumer_tp, consumer_rank):
        holders = [p for p in range(producer_tp) if h in rank_heads(total_heads, producer_tp, p)]
        out[h] = near if near in holders else holders[consumer_rank % len(holders)]
    return out


def lease_readers(total_heads: int, producer_tp: int, consumer_tp: int) -> dict[int, list[int]]:
    """For each producer rank: the consumer ranks that acquire (and release) its lease. Those
    that read heads from it; a rank nobody reads (an unneeded replica) is acquired and released
    by consumer rank ``p mod consumer_tp`` alone, so every producer rank's lease ends."""
    readers: dict[int, list[int]] = {p: [] for p in range(producer_tp)}
    for c in range(consumer_tp):
        for p in sorted(set(head_sources(total_heads, producer_tp, consumer_tp, c).values())):
            readers[p].append(c)
    for p, ranks in readers.items():
        if not ranks:
            ranks.append(p % consumer_tp)
    return readers


def plan_pull(
    src: Sequence[MemSegment],
    dst: Sequence[MemSegment],
    *,
    heads: Sequence[int],
    src_heads: range,
    dst_heads: range,
    src_block_size: int,
    dst_block_size: int,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    first_token: int,
    end_token: int,
) -> list[Region]:
    """Copies of prompt tokens ``[first_token, end_token)`` of ``heads`` (model-wide ids) from
    one producer rank (holding ``src_heads``, token ``t`` in ``remote_block_ids[t //
    src_block_size]``) to this consumer rank (holding ``dst_heads``, token ``t`` in
    ``local_block_ids[(t - first_token) // dst_block_size]``; ``first_token`` is where its
    first local block starts). Equal block sizes and head sets copy whole blocks."""
    if len(src) != len(dst):
        raise PlanError(f"{len(src)} remote segments (layers x K/V) vs {len(dst)} local ones")
    if first_token % dst_block_size:
        raise PlanError(f"first token {first_token} is not at a local block start")
    n_local = -(-end_token // dst_block_size) - first_token // dst_block_size
    if len(local_block_ids) != n_local:
        raise PlanError(
            f"{len(local_block_ids)} local blocks for tokens {first_token}..{end_token} of "
            f"block size {dst_block_size}, expected {n_local}"
        )
    if len(remote_block_ids) < -(-end_token // src_block_size):
        raise PlanError(
            f"{len(remote_block_ids)} remote blocks of size {src_block_size} cannot hold "
            f"{end_token} tokens"
        )
    for h in heads:
        if h not in src_heads or h not in dst_heads:
            raise PlanError(f"head {h} is not in remote heads {src_heads} and local {dst_heads}")
    for side, segs, block_size in (("remote", src, src_block_size), ("local", dst, dst_block_size)):
        if any(x.tokens and x.tokens != block_size for x in segs):
            raise PlanError(f"{side} segments hold blocks of another size than {block_size}")
    same = (
        src_block_size == dst_block_size
        and list(heads) == list(src_heads) == list(dst_heads)
        and all(s.interior == d.interior for s, d in zip(src, dst, strict=True))
    )
    if same:
        first = first_token // src_block_size
        return plan_regions(src, dst, remote_block_ids[first : first + n_local], local_block_ids)
    regions: list[Region] = []
    for s, d in zip(src, dst, strict=True):
        if not (s.unit_len and d.unit_len):
            raise PlanError("a segment's block interior is not described: whole blocks only")
        if s.unit_len != d.unit_len:
            raise PlanError(
                f"{s.unit_len} B per head unit remotely vs {d.unit_len} B locally "
                "(another head size, dtype or block size)"
            )
        if s.heads != len(src_heads) or d.heads != len(dst_heads):
            raise PlanError(
                f"segments hold {s.heads} (remote) and {d.heads} (local) heads, the TP shares "
                f"{len(src_heads)} and {len(dst_heads)}"
            )
        unit = s.unit_len
        if bool(s.token_stride) != bool(d.token_stride):
            raise PlanError("one side describes tokens, the other whole head slabs")
        if not s.token_stride:  # whole head slabs of whole blocks
            if src_block_size != dst_block_size:
                raise PlanError(
                    f"block size {src_block_size} remotely vs {dst_block_size} locally, and a "
                    "block's tokens are not byte ranges in this attention backend"
                )
            first = first_token // src_block_size
            for i, lb in enumerate(local_block_ids):
                src_block = s.base_addr + remote_block_ids[first + i] * s.block_stride
                dst_block = d.base_addr + lb * d.block_stride
                for h in heads:
                    append_region(
                        regions,
                        src_block + (h - src_heads.start) * s.head_stride,
                        dst_block + (h - dst_heads.start) * d.head_stride,
                        unit,
                    )
            continue
        runs = s.token_stride == unit and d.token_stride == unit  # tokens of a head adjacent
        t = first_token
        while t < end_token:
            so, do = t % src_block_size, t % dst_block_size
            n = min(src_block_size - so, dst_block_size - do, end_token - t)
            src_block = s.base_addr + remote_block_ids[t // src_block_size] * s.block_stride
            dst_block = (
                d.base_addr + local_block_ids[(t - first_token) // dst_block_size] * d.block_stride
            )
            for h in heads:
                sa = src_block + (h - src_heads.start) * s.head_stride + so * s.token_stride
                da = dst_block + (h - dst_heads.start) * d.head_stride + do * d.token_stride
                if runs:
                    append_region(regions, sa, da, n * unit)
                else:
                    for k in range(n):
                        append_region(
                            regions, sa + k * s.token_stride, da + k * d.token_stride, unit
                        )
            t += n
    return regions


def append_region(regions: list[Region], src_addr: int, dst_addr: int, length: int) -> None:
    """Adds a copy, merged into the last one where both sides continue it."""
    if regions:
        last = regions[-1]
        if last.src_addr + last.length == src_addr and last.dst_addr + last.length == dst_addr:
            regions[-1] = Region(last.src_addr, last.dst_addr, last.length + length)
            return
    regions.append(Region(src_addr, dst_addr, length))


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
