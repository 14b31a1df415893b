"""Property tests of the pull planner (``mooncake_vllm.core.planning``) against a reference gather.

Hypothesis draws small random pulls: producer and consumer TP sizes, KV heads, head size, dtype,
a block size per side, 1-3 layers, and one per-layer tensor family for both sides: vLLM CPU
attention's ``[num_blocks, heads, block_size, 2 * head_size]`` (one segment per layer), a
flash-like ``[2, num_blocks, block_size, heads, head_size]`` (K and V segments) or an MLA latent
``[num_blocks, block_size, latent]``, or as vLLM's ``[num_blocks, 1, block_size, latent]`` view
(one replicated head). Each side keeps its layers in one buffer, layer after layer or block after
block (then the block stride exceeds the block length), and a block's tokens are byte ranges or
(``tokens_addressable=False``) opaque per-head slabs.
The caches are real CPU tensors; every consumer rank plans its pull with ``head_sources`` and
``plan_pull``, the regions run as raw memory copies, and the consumer's memory is compared bit for
bit with a gather done by plain tensor indexing. Checked:

1. every prompt token from ``first_token`` on, for every head a consumer rank holds, is the
   producer's, and nothing else of the consumer's memory changes (a whole-block or whole-slab
   copy may also fill the unused tail of the prompt's last block);
2. a pull's regions lie in the prompt's blocks on both sides (merged copies may span adjacent
   blocks), never read a byte twice nor write one twice, and a per-token plan copies exactly
   ``tokens x heads x unit x segments`` bytes (a per-block one, the heads' share of each block);
3. ``head_sources`` and ``lease_readers``: one holder per head, replicas spread evenly, every
   producer rank's lease acquired by its readers or by one give-back rank;
4. equal layouts: ``plan_pull`` is ``plan_regions`` over the prompt's block ids;
5. mismatched layouts and block lists are refused.

Values are compared as integers of the dtype's width, so any wrong byte is visible whatever the
dtype. A block whose local heads equal its tokens is refused (its shape cannot tell them apart):
such layouts stay out of the random ones, and the refusal is checked at the end.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, replace

import msgspec
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mooncake_vllm.core.planning import (
    MemSegment,
    PlanError,
    head_sources,
    lease_readers,
    plan_pull,
    plan_regions,
    rank_heads,
    tensor_segments,
)

FAMILIES = ("cpu", "flash", "mla", "mla_view")
INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SENTINEL = -1  # every consumer element (as an integer) before the pull; producer filler < -1
MAX_PROMPT = 40  # keeps every (layer, kv, head, token, element) code below 2**15


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _splits(heads: int, tp: int) -> bool:
    """Whether ``rank_heads`` accepts ``heads`` KV heads over TP size ``tp``."""
    return heads % tp == 0 if heads >= tp else tp % heads == 0


# ---- layouts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One side's KV cache: the model's heads, its TP size, and how each rank lays a layer out."""

    family: str  # one of FAMILIES
    total_heads: int
    tp: int
    block_size: int
    num_blocks: int
    layers: int
    head_size: int  # elements of K (or of V) per head and token; an MLA latent's width
    dtype: torch.dtype
    interleaved: bool = False  # one buffer block after block (else layer after layer)
    tokens_addressable: bool = True  # else a head's part of a block is one opaque slab

    def heads(self, rank: int) -> range:
        return rank_heads(self.total_heads, self.tp, rank)

    @property
    def heads_local(self) -> int:
        return len(self.heads(0))

    @property
    def kv(self) -> int:
        """K and V, or one latent."""
        return 1 if self.family.startswith("mla") else 2

    @property
    def unit_bytes(self) -> int:
        """Bytes of one (head, token) unit: K and V together in the CPU layout."""
        elems = 2 * self.head_size if self.family == "cpu" else self.head_size
        return elems * torch.finfo(self.dtype).bits // 8

    @property
    def ambiguous(self) -> bool:
        """A block with as many local heads as tokens, described token by token: its shape
        cannot tell the two apart, so tensor_segments refuses it (see the last test)."""
        return (
            self.tokens_addressable
            and not self.family.startswith("mla")
            and self.heads_local == self.block_size > 1
        )

    def buffer(self) -> torch.Tensor:
        """One rank's KV memory, every layer in one buffer."""
        hl, b, hs = self.heads_local, self.block_size, self.head_size
        block = {
            "cpu": (hl, b, 2 * hs),
            "flash": (b, hl, hs),
            "mla": (b, hs),
            "mla_view": (1, b, hs),
        }[self.family]
        outer = (2, self.num_blocks) if self.family == "flash" else (self.num_blocks,)
        if self.interleaved:
            return torch.empty((*outer, self.layers, *block), dtype=self.dtype)
        return torch.empty((self.layers, *outer, *block), dtype=self.dtype)

    def layer_tensors(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's tensor as the engine hands it to the connector (views of ``buf``)."""
        if not self.interleaved:
            return [buf[layer] for layer in range(self.layers)]
        lead = (slice(None),) * (2 if self.family == "flash" else 1)
        return [buf[(*lead, layer)] for layer in range(self.layers)]

    def units(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each layer of ``buf`` viewed as ``[kv, block, slot, local head, element]``."""
        out = []
        for t in self.layer_tensors(buf):
            if self.family == "cpu":  # [block, head, slot, (kv, element)]
                t = t.unflatten(-1, (2, self.head_size)).permute(3, 0, 2, 1, 4)
            elif self.family == "mla":  # [block, slot, element]
                t = t[None, :, :, None, :]
            elif self.family == "mla_view":  # [block, 1, slot, element]
                t = t.permute(1, 0, 2, 3).unsqueeze(3)
            out.append(t)
        return out

    def segments(self, buf: torch.Tensor) -> list[MemSegment]:
        return [
            seg
            for t in self.layer_tensors(buf)
            for seg in tensor_segments(
                t.data_ptr(),
                t.shape,
                t.stride(),
                t.element_size(),
                self.num_blocks,
                block_size=self.block_size,
                heads=self.heads_local,
                tokens_addressable=self.tokens_addressable,
            )
        ]


@dataclass(frozen=True)
class Pull:
    producer: Layout
    consumer: Layout
    prompt_len: int
    remote_block_ids: list[int]  # the whole prompt's blocks on every producer rank
    local_block_ids: list[int]  # the blocks from first_token on, on every consumer rank
    first_token: int  # the consumer has tokens before it cached already

    @property
    def used_remote_blocks(self) -> set[int]:
        first = self.first_token // self.producer.block_size
        return set(self.remote_block_ids[first : _cdiv(self.prompt_len, self.producer.block_size)])

    def plan(self, src: list[MemSegment], dst: list[MemSegment], heads, p: int, c: int):
        return plan_pull(
            src,
            dst,
            heads=heads,
            src_heads=self.producer.heads(p),
            dst_heads=self.consumer.heads(c),
            src_block_size=self.producer.block_size,
            dst_block_size=self.consumer.block_size,
            remote_block_ids=self.remote_block_ids,
            local_block_ids=self.local_block_ids,
            first_token=self.first_token,
            end_token=self.prompt_len,
        )


TP_SIZES = st.sampled_from([1, 2, 4])
BLOCK_SIZES = st.sampled_from([2, 4, 8, 16])


@st.composite
def pulls(draw, equal_layouts: bool = False, slabs: bool = False) -> Pull:
    """A random pull; ``equal_layouts``: same TP size and block size on both sides; ``slabs``:
    tokens not addressable (heads outermost in a block, block sizes equal) on both sides."""
    family = draw(st.sampled_from([f for f in FAMILIES if f != "flash"] if slabs else FAMILIES))
    total_heads = 1 if family.startswith("mla") else draw(st.sampled_from([1, 2, 4, 8]))
    p_tp = draw(TP_SIZES)
    c_tp = p_tp if equal_layouts else draw(TP_SIZES)
    # Powers of two always split; kept explicit for whoever widens the choices.
    assume(_splits(total_heads, p_tp) and _splits(total_heads, c_tp))
    head_size = draw(st.sampled_from([1, 2, 4]))
    dtype = draw(st.sampled_from(list(INT_OF)))
    layers = draw(st.integers(1, 3))
    prompt_len = draw(st.integers(1, MAX_PROMPT))
    bp = draw(BLOCK_SIZES)
    bc = bp if equal_layouts or slabs else draw(BLOCK_SIZES)
    # A flash-like tensor's first dimension is 2 (K, V): num_blocks 2 would be taken for it.
    min_blocks = 3 if family == "flash" else 1
    n_remote = _cdiv(prompt_len, bp)
    nb_p = max(min_blocks, n_remote + draw(st.integers(0, 3)))
    remote = draw(st.permutations(range(nb_p)))[:n_remote]
    cached = draw(st.integers(0, _cdiv(prompt_len, bc) - 1))  # consumer blocks already cached
    n_local = _cdiv(prompt_len, bc) - cached
    nb_c = max(min_blocks, n_local + draw(st.integers(0, 3)))
    local = draw(st.permutations(range(nb_c)))[:n_local]
    common = dict(
        family=family,
        total_heads=total_heads,
        layers=layers,
        head_size=head_size,
        dtype=dtype,
        tokens_addressable=not slabs,
    )
    producer = Layout(
        tp=p_tp, block_size=bp, num_blocks=nb_p, interleaved=draw(st.booleans()), **common
    )
    consumer = Layout(
        tp=c_tp, block_size=bc, num_blocks=nb_c, interleaved=draw(st.booleans()), **common
    )
    assume(not producer.ambiguous and not consumer.ambiguous)
    return Pull(producer, consumer, prompt_len, remote, local, cached * bc)


# ---- the reference gather ---------------------------------------------------------------------


def _ints(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(INT_OF[buf.dtype])


def _codes(pull: Pull, dtype: torch.dtype) -> torch.Tensor:
    """``[layer, kv, head, token, element]``: a distinct positive code for every prompt value."""
    p = pull.producer
    shape = (p.layers, p.kv, p.total_heads, pull.prompt_len, p.head_size)
    n = p.layers * p.kv * p.total_heads * pull.prompt_len * p.head_size
    assert n < 2**15
    return torch.arange(1, n + 1, dtype=dtype).reshape(shape)


def _scatter(units, codes, heads, local_start, block_ids, block_size, tokens, first=0) -> None:
    """Write ``codes[layer, :, h, t]`` for ``heads`` and ``tokens`` where a cache keeps them: token
    ``t`` in slot ``t % block_size`` of block ``block_ids[(t - first) // block_size]``, head ``h``
    at local index ``h - local_start``."""
    ts = torch.tensor(list(tokens), dtype=torch.long)
    blocks = torch.tensor(block_ids, dtype=torch.long)[(ts - first) // block_size]
    slots = ts % block_size
    hs = torch.tensor(list(heads), dtype=torch.long)
    local = hs - local_start
    for layer, u in enumerate(units):
        values = codes[layer][:, hs][:, :, ts].transpose(1, 2)  # [kv, token, head, element]
        u[:, blocks[:, None], slots[:, None], local[None, :]] = values


def _blocks_touched(addr: int, length: int, segments, num_blocks: int) -> list[int]:
    """The blocks bytes ``[addr, addr + length)`` lie in; fails if a byte lies in none (a gap
    between blocks, another buffer)."""
    blocks, end = [], addr + length
    while addr < end:
        for s in segments:
            b, off = divmod(addr - s.base_addr, s.block_stride)
            if 0 <= b < num_blocks and off < s.block_len:
                blocks.append(b)
                addr = min(end, addr - off + s.block_len)
                break
        else:
            raise AssertionError(f"byte {addr:#x} of a region lies in no block")
    return blocks


def _assert_disjoint(ranges: list[tuple[int, int]], side: str) -> None:
    ranges = sorted(ranges)
    for (a, n), (b, _) in itertools.pairwise(ranges):
        assert a + n <= b, f"{side} bytes {b:#x}.. copied twice"


def _check_regions(pull: Pull, regions, src, dst, heads, per_block: bool) -> None:
    """Property 2 for one producer → consumer pull; run before any copy (addresses are real)."""
    prod, cons = pull.producer, pull.consumer
    for r in regions:
        assert r.length > 0
        touched = _blocks_touched(r.src_addr, r.length, src, prod.num_blocks)
        assert set(touched) <= pull.used_remote_blocks, "reads a block outside the prompt"
        touched = _blocks_touched(r.dst_addr, r.length, dst, cons.num_blocks)
        assert set(touched) <= set(pull.local_block_ids), "writes a block not given to it"
    _assert_disjoint([(r.src_addr, r.length) for r in regions], "source")
    _assert_disjoint([(r.dst_addr, r.length) for r in regions], "destination")
    total = sum(r.length for r in regions)
    if per_block:  # the heads' share of every block
        share = len(heads) * sum(s.block_len for s in dst) // cons.heads_local
        assert total == len(pull.local_block_ids) * share
    else:
        tokens = pull.prompt_len - pull.first_token
        assert total == tokens * len(heads) * cons.unit_bytes * len(dst)


def _first_differences(layout: Layout, actual: torch.Tensor, expected: torch.Tensor) -> str:
    lines = []
    for layer, (a, e) in enumerate(zip(layout.units(actual), layout.units(expected), strict=True)):
        for idx in (a != e).nonzero()[:3].tolist():
            kv, block, slot, head = idx[:4]
            lines.append(
                f"layer {layer} kv {kv} block {block} slot {slot} local head {head} element "
                f"{idx[4]}: {a[tuple(idx)].item()} != expected {e[tuple(idx)].item()}"
            )
    return "\n".join(lines)


def _producer_buffers(pull: Pull) -> list[torch.Tensor]:
    """Every producer rank's memory: filler below the sentinel, the prompt where it belongs."""
    prod = pull.producer
    bufs = []
    for p in range(prod.tp):
        buf = prod.buffer()
        ints = _ints(buf)
        filler = -(torch.arange(ints.numel()) % 30000) - 2
        ints.copy_(filler.reshape(ints.shape))
        codes = _codes(pull, ints.dtype)
        heads = prod.heads(p)
        _scatter(
            prod.units(ints),
            codes,
            heads,
            heads.start,
            pull.remote_block_ids,
            prod.block_size,
            range(pull.prompt_len),
        )
        bufs.append(buf)
    return bufs


def _pull_and_compare(pull: Pull) -> None:
    prod, cons = pull.producer, pull.consumer
    first, end = pull.first_token, pull.prompt_len
    src_bufs = _producer_buffers(pull)
    for c in range(cons.tp):
        buf = cons.buffer()
        ints = _ints(buf)
        ints.fill_(SENTINEL)
        expected = ints.clone()
        exp_units = cons.units(expected)
        dst = cons.segments(buf)
        dst_heads = cons.heads(c)
        sources = head_sources(cons.total_heads, prod.tp, cons.tp, c)
        planned = []
        for p in sorted(set(sources.values())):
            heads = [h for h, q in sources.items() if q == p]
            src = prod.segments(src_bufs[p])
            regions = pull.plan(src, dst, heads, p, c)
            # Whole blocks (equal layouts), or each head's slab of them (tokens not addressable):
            # local block i is the producer's block, whatever the tail past the prompt holds.
            per_block = not cons.tokens_addressable or (
                prod.block_size == cons.block_size
                and heads == list(prod.heads(p)) == list(dst_heads)
            )
            _check_regions(pull, regions, src, dst, heads, per_block)
            if per_block:
                src_units = prod.units(_ints(src_bufs[p]))
                start = first // prod.block_size
                src_h = [h - prod.heads(p).start for h in heads]
                dst_h = [h - dst_heads.start for h in heads]
                for i, lb in enumerate(pull.local_block_ids):
                    rb = pull.remote_block_ids[start + i]
                    for e, s in zip(exp_units, src_units, strict=True):
                        e[:, lb, :, dst_h] = s[:, rb, :, src_h]
            else:
                codes = _codes(pull, ints.dtype)
                where = (pull.local_block_ids, cons.block_size, range(first, end), first)
                _scatter(exp_units, codes, heads, dst_heads.start, *where)
            planned += regions
        _assert_disjoint([(r.dst_addr, r.length) for r in planned], "destination")
        for r in planned:  # every address was checked to lie in a block of a live buffer
            ctypes.memmove(r.dst_addr, r.src_addr, r.length)
        assert torch.equal(ints, expected), (
            f"consumer rank {c} of {pull}:\n{_first_differences(cons, ints, expected)}"
        )


@settings(max_examples=300, deadline=None)
@given(pulls())
def test_a_pull_gathers_exactly_the_prompt_heads_and_tokens(pull):
    _pull_and_compare(pull)


@settings(max_examples=100, deadline=None)
@given(pulls(equal_layouts=True))
def test_equal_layouts_gather_too(pull):
    # The whole-block path, drawn every time (the general strategy reaches it less often).
    _pull_and_compare(pull)


@settings(max_examples=100, deadline=None)
@given(pulls(slabs=True))
def test_opaque_blocks_gather_each_heads_slab(pull):
    # Tokens not addressable (the backend's own format below the head dimension): each head's
    # slab of every block the prompt uses, block for block.
    _pull_and_compare(pull)


@settings(max_examples=100, deadline=None)
@given(pulls())
def test_segments_describe_each_block_interior(pull):
    # What plan_pull relies on: tensor_segments' strides are the tensor's own.
    layout = pull.consumer
    buf = layout.buffer()
    segments = layout.segments(buf)
    per_layer = len(segments) // layout.layers
    itemsize = buf.element_size()
    block_dim = 1 if layout.family == "flash" else 0
    for i, seg in enumerate(segments):
        layer = layout.layer_tensors(buf)[i // per_layer]
        u = layout.units(buf)[i // per_layer][i % per_layer]  # [block, slot, head, element]
        assert seg.base_addr == u.data_ptr()
        # (from the layer tensor: a view's size-1 dimensions may get other strides)
        assert seg.block_stride == layer.stride(block_dim) * itemsize
        assert seg.block_len == u[0].numel() * itemsize * (2 if layout.family == "cpu" else 1)
        assert (seg.heads, seg.tokens) == (layout.heads_local, layout.block_size)
        assert seg.token_stride == u.stride(1) * itemsize
        if layout.heads_local > 1:
            assert seg.head_stride == u.stride(2) * itemsize
        assert seg.unit_len == layout.unit_bytes


# ---- which producer rank each head comes from -------------------------------------------------

TP_CHOICES = (1, 2, 3, 4, 6, 8)
SHARDINGS = [
    (h, p, c)
    for h in (1, 2, 3, 4, 6, 8, 12, 16)
    for p in TP_CHOICES
    for c in TP_CHOICES
    if _splits(h, p) and _splits(h, c)
]


@pytest.mark.parametrize(("total_heads", "producer_tp", "consumer_tp"), SHARDINGS)
def test_every_head_has_one_source_and_every_lease_a_reader(total_heads, producer_tp, consumer_tp):
    sources = [head_sources(total_heads, producer_tp, consumer_tp, c) for c in range(consumer_tp)]
    for c, src in enumerate(sources):
        assert list(src) == list(rank_heads(total_heads, consumer_tp, c))
        near = c * producer_tp // consumer_tp  # the producer rank at the same relative position
        for h, p in src.items():
            assert h in rank_heads(total_heads, producer_tp, p)
            if h in rank_heads(total_heads, producer_tp, near):
                assert p == near
    readers = lease_readers(total_heads, producer_tp, consumer_tp)
    assert list(readers) == list(range(producer_tp))
    for p, ranks in readers.items():
        reading = [c for c in range(consumer_tp) if p in sources[c].values()]
        assert ranks == (reading or [p % consumer_tp])
        if total_heads >= producer_tp:  # no replicas: p is read by whoever holds its heads
            mine = set(rank_heads(total_heads, producer_tp, p))
            holders = [
                c for c in range(consumer_tp) if mine & set(rank_heads(total_heads, consumer_tp, c))
            ]
            assert ranks == holders


@pytest.mark.parametrize(("total_heads", "producer_tp", "consumer_tp"), SHARDINGS)
def test_replicated_heads_are_read_from_as_many_producer_ranks_as_possible(
    total_heads, producer_tp, consumer_tp
):
    for h in range(total_heads):
        readers = [c for c in range(consumer_tp) if h in rank_heads(total_heads, consumer_tp, c)]
        holders = [p for p in range(producer_tp) if h in rank_heads(total_heads, producer_tp, p)]
        load: dict[int, int] = {}
        for c in readers:
            p = head_sources(total_heads, producer_tp, consumer_tp, c)[h]
            load[p] = load.get(p, 0) + 1
        if total_heads < producer_tp <= consumer_tp and len(readers) > 1 and len(holders) > 1:
            assert len(load) > 1
        # Evenly: as many producer ranks as readers allow, loads differing by one at most.
        assert len(load) == min(len(readers), len(holders))
        assert max(load.values()) - min(load.values()) <= 1


# ---- equal layouts: whole blocks --------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(pulls(equal_layouts=True))
def test_equal_layouts_plan_whole_blocks(pull):
    prod, cons = pull.producer, pull.consumer
    src_bufs = [prod.buffer() for _ in range(prod.tp)]
    first = pull.first_token // prod.block_size
    n_local = len(pull.local_block_ids)
    for c in range(cons.tp):
        sources = head_sources(cons.total_heads, prod.tp, cons.tp, c)
        assert set(sources.values()) == {c}
        src, dst = prod.segments(src_bufs[c]), cons.segments(cons.buffer())
        regions = pull.plan(src, dst, list(sources), c, c)
        blocks = pull.remote_block_ids[first : first + n_local]
        assert regions == plan_regions(src, dst, blocks, pull.local_block_ids)


# ---- refusals ---------------------------------------------------------------------------------


def _fake_segments(layout: Layout, base: int = 0x10000) -> list[MemSegment]:
    """A layout's segments at a made-up address (nothing is copied)."""
    buf = layout.buffer()
    return [
        msgspec.structs.replace(s, base_addr=s.base_addr - buf.data_ptr() + base)
        for s in layout.segments(buf)
    ]


CPU4 = Layout("cpu", 2, 1, 4, 8, 2, 2, torch.float32)  # 2 heads on one rank, 2 layers
PROMPT = 10  # tokens: 3 blocks of 4


def _refused_pull(**change) -> None:
    args = dict(
        heads=[0, 1],
        src_heads=range(2),
        dst_heads=range(2),
        src_block_size=4,
        dst_block_size=4,
        remote_block_ids=[5, 1, 2],
        local_block_ids=[6, 7],
        first_token=4,
        end_token=PROMPT,
    )
    src = change.pop("src", _fake_segments(CPU4))
    dst = change.pop("dst", _fake_segments(CPU4, base=0x900000))
    args.update(change)
    plan_pull(src, dst, **args)


def test_the_refusal_cases_start_from_a_valid_pull():
    _refused_pull()
    blocks_of_8 = _fake_segments(replace(CPU4, block_size=8), base=0x900000)
    _refused_pull(dst=blocks_of_8, dst_block_size=8, local_block_ids=[6], first_token=8)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # another head size, another dtype: other bytes per (head, token)
        ({"dst": _fake_segments(replace(CPU4, head_size=4))}, "B per head"),
        ({"dst": _fake_segments(replace(CPU4, dtype=torch.float16))}, "B per head"),
        # ... also where the block sizes differ anyway
        (
            {
                "dst": _fake_segments(replace(CPU4, head_size=4, block_size=1)),
                "dst_block_size": 1,
                "local_block_ids": [0, 1, 2, 3, 4, 5],
            },
            "B per head",
        ),
        ({"dst": _fake_segments(replace(CPU4, layers=3))}, "segments"),
        ({"first_token": 2}, "not at a local block start"),
        ({"local_block_ids": [6]}, "1 local blocks"),
        ({"local_block_ids": [6, 7, 0]}, "3 local blocks"),
        ({"remote_block_ids": [5, 1]}, "cannot hold 10 tokens"),
        # a head the producer rank does not hold
        ({"heads": [1], "src_heads": range(1), "dst_heads": range(2)}, "head 1"),
        # a segment holding other heads than the TP share it is said to
        ({"heads": [0], "src_heads": range(1), "dst_heads": range(2)}, "segments hold 2"),
        # the interior undescribed: whole blocks only, and the block sizes differ
        (
            {
                "src": [MemSegment(0x10000, 512, 512)],
                "dst": [MemSegment(0x90000, 256, 256)],
                "dst_block_size": 2,
                "local_block_ids": [3, 4, 5],
            },
            "not described",
        ),
        # opaque head slabs of equal length (half the tokens, twice the head size), yet the
        # block sizes differ: slabs cannot be cut into tokens
        (
            {
                "src": _fake_segments(replace(CPU4, tokens_addressable=False)),
                "dst": _fake_segments(
                    replace(CPU4, block_size=2, head_size=4, tokens_addressable=False)
                ),
                "dst_block_size": 2,
                "local_block_ids": [3, 4, 5],
            },
            "block size",
        ),
    ],
)
def test_mismatched_pulls_are_refused(change, match):
    with pytest.raises(PlanError, match=match):
        _refused_pull(**change)


@pytest.mark.parametrize(
    ("total_heads", "tp", "rank"),
    [(3, 2, 0), (6, 4, 1), (2, 3, 0), (4, 6, 5), (4, 2, 2), (4, 2, -1)],
)
def test_heads_that_do_not_shard_are_refused(total_heads, tp, rank):
    with pytest.raises(PlanError):
        rank_heads(total_heads, tp, rank)


# ---- an ambiguous block ------------------------------------------------------------------------


def test_a_flash_like_block_with_as_many_local_heads_as_tokens_is_not_described():
    """[block_size, heads, head_size] with heads == block_size: which dimension is which cannot be
    read from the shape, so the interior is refused (the connector then copies whole blocks)."""
    flash = dict(family="flash", total_heads=4, tp=1, layers=1, head_size=2, dtype=torch.float32)
    producer = Layout(block_size=4, num_blocks=4, **flash)
    with pytest.raises(PlanError, match="which is which"):
        producer.segments(producer.buffer())
