"""Wire formats: the handoff in ``kv_transfer_params`` and the side-channel frames.

Both are versioned msgspec structs. The handoff travels through the proxy as JSON; side-channel
frames are msgpack over ZeroMQ between a consumer worker and the producer worker of the same rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from mooncake_vllm.core.auth import short_id
from mooncake_vllm.core.planning import MemSegment
from mooncake_vllm.core.prompt_identity import request_identity

PROTOCOL_VERSION = 1


# Pipeline stages a handoff may name (vLLM's own limit is the model's layer count).
MAX_PP_SIZE = 64


class HandoffError(ValueError):
    """``kv_transfer_params`` that cannot be used for a pull."""


class Handoff(msgspec.Struct, frozen=True, kw_only=True):
    """What the producer returns from ``request_finished``; the consumer receives it back."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    version: int = PROTOCOL_VERSION
    transfer_id: str
    producer_engine_id: str
    # Where to reach the producer, one port per worker rank (PP rank × TP size + TP rank).
    # Empty: look the producer up by ``producer_engine_id`` in the engine registry (needs a
    # metadata store on the consumer).
    side_channel_host: str = ""
    side_channel_ports: list[int] = []
    producer_tp_size: int
    # Pipeline parallel: each stage's workers hold that stage's layers (a grant names them).
    producer_pp_size: int = 1
    remote_block_ids: list[int]
    # A hybrid model's KV cache groups 1.. (``remote_block_ids`` is group 0): each group's
    # prompt blocks by position, the null block (0) where a sliding window had freed one.
    group_block_ids: list[list[int]] = []
    prompt_len: int
    block_size: int
    compat_hash: str
    # The producer's KV layout in words (``kv_layout``), for the error when the hashes differ.
    kv_layout: str = ""
    # How a block keeps its tokens (``vllm_glue.kv_format``): a consumer of another block size
    # re-blocks only a format it knows (``core.reblock``).
    kv_format: str = ""
    # Which start of the producer holds the lease: a producer restarted on the same address
    # refuses the handoffs of its previous life by this, not only by their unknown ids.
    producer_incarnation: str = ""
    # ``prompt_digest`` of the prompt whose KV the lease holds: a consumer takes it only for a
    # request with the same prompt (a transfer id an orchestrator used for two requests).
    prompt_digest: str = ""

    def to_params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def prompt_digest(token_ids: Sequence[int] | None, identity: bytes = b"") -> str:
    """What binds a lease to its prompt: a 128-bit BLAKE2b of the prompt's token ids ("" when
    the prompt has none, e.g. prompt embeddings), then of ``identity`` (the LoRA adapter, the
    multimodal inputs and the ``cache_salt``: ``core.prompt_identity.request_identity``; ``b""``
    for a plain prompt, whose digest is the ids' alone). Both halves tokenize the same request,
    so a decode whose prompt differs from the prefill's under one transfer id, in its tokens or
    in what else decides its KV, is told apart before a byte moves (``LeaseTable.acquire``,
    ``validate_handoff``)."""
    if not token_ids:
        return ""
    h = hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16)
    if identity:
        h.update(b"\0identity\0" + identity)
    return h.hexdigest()


def request_prompt_digest(request: Any) -> str:
    """``prompt_digest`` of a vLLM ``Request``: its token ids and its identity."""
    return prompt_digest(request.prompt_token_ids, request_identity(request))


class PendingHandoff(msgspec.Struct, frozen=True, kw_only=True):
    """A handoff sent with the prefill leg, before the prefill has finished (the proxy's
    ``--dispatch concurrent``): the proxy chose ``transfer_id`` and gave it to the prefill too,
    and knows where the producer is from its earlier handoffs. The consumer's acquire waits at the
    producer's side channel until the prefill's lease exists, and the grant carries the rest of
    the ``Handoff`` (blocks, block size, compat hash, incarnation), checked before a byte moves."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    pending: bool = True
    version: int = PROTOCOL_VERSION
    transfer_id: str
    producer_engine_id: str
    # Empty, with ``bootstrap_addr`` set: vLLM's upstream convention (``p2p.upstream``); the
    # consumer's worker fills them in from the producer's bootstrap ``/query`` before it acquires.
    side_channel_host: str = ""
    side_channel_ports: list[int] = []
    producer_tp_size: int = 0
    producer_pp_size: int = 1
    bootstrap_addr: str = ""

    @property
    def unresolved(self) -> bool:
        """Named by its bootstrap only: the worker resolves it (``upstream.BootstrapResolver``)."""
        return bool(self.bootstrap_addr) and not self.side_channel_ports

    def to_params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


# The transfer ids a client may choose, as vLLM's upstream connector takes any string its
# orchestrator sends (its mooncake proxy ``xfer-<uuid4>``, llm-d and Dynamo a uuid4, others
# ``xfer-<request id>``), bounded: 1-128 letters, digits and ``._:-``.
TRANSFER_ID_CHARS = "letters, digits and ._:-"
MAX_TRANSFER_ID = 128
_CLIENT_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_TRANSFER_ID}}}")


def is_transfer_id(value: object) -> bool:
    """A transfer id a producer takes from a client (our proxy's 32 hex digits, upstream's
    orchestrators' ids): 1-128 letters, digits and ``._:-``. What keeps a lease safe is not
    that its name is secret: the producer never takes an id twice
    (``SchedulerHalf._new_transfer_id``), a lease is granted only to a decode of its own
    prompt (``prompt_digest``), and the side channel's frames are authenticated when a secret
    is set. An id a stranger can guess can still be used first by whoever reaches the engine's
    API, which makes the real request's handoff refused: send random ids (upstream's
    orchestrators do) and keep the API behind the proxy."""
    return isinstance(value, str) and _CLIENT_ID.fullmatch(value) is not None


def parse_pending(params: dict[str, Any]) -> PendingHandoff:
    """Decode a pending handoff from a client; raises HandoffError naming the problem."""
    try:
        h = msgspec.convert(params, PendingHandoff)
    except msgspec.ValidationError as e:
        raise HandoffError(f"malformed pending kv_transfer_params: {e}") from e
    if not is_transfer_id(h.transfer_id):
        raise HandoffError(
            f"a pending handoff's transfer_id must be 1-{MAX_TRANSFER_ID} {TRANSFER_ID_CHARS}"
        )
    if not (h.side_channel_host and h.side_channel_ports):
        raise HandoffError("a pending handoff names the producer's side channel")
    _check_producer(h)
    return h


def _check_producer(h: Handoff | PendingHandoff) -> None:
    """What every handoff must say about its producer, and in this version."""
    if h.version != PROTOCOL_VERSION:
        raise HandoffError(f"handoff version {h.version}, this consumer speaks {PROTOCOL_VERSION}")
    if not h.producer_engine_id:
        raise HandoffError("empty producer_engine_id")
    if h.producer_tp_size < 1:
        raise HandoffError(f"producer_tp_size {h.producer_tp_size} must be at least 1")
    if not 1 <= h.producer_pp_size <= MAX_PP_SIZE:
        raise HandoffError(f"producer_pp_size {h.producer_pp_size} must be 1..{MAX_PP_SIZE}")
    ranks = h.producer_tp_size * h.producer_pp_size
    if h.side_channel_ports and len(h.side_channel_ports) != ranks:
        raise HandoffError(
            f"{len(h.side_channel_ports)} side_channel_ports for producer_tp_size "
            f"{h.producer_tp_size} × producer_pp_size {h.producer_pp_size} (one port per "
            "producer worker)"
        )


def parse_handoff(params: dict[str, Any]) -> Handoff:
    """Decode ``kv_transfer_params`` from a client; raises HandoffError naming the problem."""
    try:
        h = msgspec.convert(params, Handoff)
    except msgspec.ValidationError as e:
        raise HandoffError(f"malformed kv_transfer_params: {e}") from e
    if not h.transfer_id:
        raise HandoffError("empty transfer_id")
    if bool(h.side_channel_host) != bool(h.side_channel_ports):
        raise HandoffError(
            "side_channel_host and side_channel_ports go together (give both, or neither to "
            "look the producer up by producer_engine_id)"
        )
    _check_producer(h)
    return h


@dataclasses.dataclass(frozen=True)
class HandoffChecks:
    """What a consumer checks a handoff against (``validate_handoff``'s arguments): the request
    (its prompt's length and digest) and this consumer (model, layout, TP, block size, groups)."""

    prompt_len: int
    compat_hash: str
    kv_heads: int
    tp_size: int
    block_size: int
    kv_layout: str = ""
    reblock_format: str = ""
    prompt_digest: str = ""
    kv_groups: int = 1

    def validate(self, h: Handoff) -> None:
        """``validate_handoff`` with these; raises HandoffError."""
        validate_handoff(h, **dataclasses.asdict(self))


def validate_handoff(
    h: Handoff,
    *,
    prompt_len: int,
    compat_hash: str,
    kv_heads: int,
    tp_size: int,
    block_size: int,
    kv_layout: str = "",
    reblock_format: str = "",
    prompt_digest: str = "",
    kv_groups: int = 1,
) -> None:
    """Check a handoff against the request and this consumer; raises HandoffError.

    TP sizes may differ (``planning.plan_pull`` reads each head from a rank that holds it); the
    model, dtypes, head size and KV heads (``kv_heads``, all ranks) must not (the compat hash).
    Block sizes may differ where both sides keep blocks in ``reblock_format`` (``core.reblock``;
    empty: this consumer does not re-block)."""
    if h.compat_hash != compat_hash:
        layouts = (
            f"; producer: {h.kv_layout}, this consumer: {kv_layout}"
            if h.kv_layout and kv_layout
            else ""
        )
        raise HandoffError(
            f"compat hash mismatch: producer {h.compat_hash[:12]}, consumer {compat_hash[:12]} "
            "(different model, dtype, KV dtype, head size, KV heads or KV layout: MLA latent "
            f"vs per-head K/V, or another MLA latent width){layouts}"
        )
    if h.prompt_len != prompt_len:
        raise HandoffError(f"prompt length {prompt_len} differs from the producer's {h.prompt_len}")
    if h.prompt_digest and prompt_digest and h.prompt_digest != prompt_digest:
        raise HandoffError(
            f"transfer_id {short_id(h.transfer_id)} holds another prompt's KV (same length, "
            "other tokens): was it used for two requests? Choose a new transfer_id for every "
            "request"
        )
    if h.block_size < 1:
        raise HandoffError(f"producer block size {h.block_size} must be at least 1")
    if len(h.group_block_ids) + 1 != kv_groups:
        raise HandoffError(
            f"{len(h.group_block_ids) + 1} KV cache groups at the producer, {kv_groups} here: "
            "serve both with the same model and the same hybrid KV cache manager setting "
            "(--disable-hybrid-kv-cache-manager on both or neither)"
        )
    if kv_groups > 1 and h.block_size != block_size:
        raise HandoffError(
            f"block size {h.block_size} at the producer, {block_size} here: a hybrid model's "
            f"{kv_groups} KV cache groups are moved at one block size only; serve both with "
            "the same --block-size"
        )
    if h.block_size != block_size and not (reblock_format and h.kv_format == reblock_format):
        why = (
            f"KV format {h.kv_format or 'unknown'!r} at the producer, this consumer re-blocks "
            f"{reblock_format!r} only"
            if reblock_format
            else "this consumer does not re-block (reblock_buffer_bytes is 0, or its own KV "
            "format is not one it can rearrange)"
        )
        raise HandoffError(
            f"block size {h.block_size} at the producer, {block_size} here, and {why}: serve "
            "both with the same --block-size"
        )
    need = -(-prompt_len // h.block_size)
    if len(h.remote_block_ids) != need:
        raise HandoffError(
            f"{len(h.remote_block_ids)} remote blocks for {prompt_len} tokens of block size "
            f"{h.block_size}, expected {need}"
        )
    if any(len(g) != need for g in h.group_block_ids):
        raise HandoffError(
            f"KV cache groups of {[len(g) for g in h.group_block_ids]} remote blocks for "
            f"{prompt_len} tokens of block size {h.block_size}, expected {need} each"
        )
    for side, tp in (("producer", h.producer_tp_size), ("consumer", tp_size)):
        if not (kv_heads % tp == 0 or tp % kv_heads == 0):
            raise HandoffError(
                f"{kv_heads} KV heads cannot be sharded over the {side}'s TP size {tp}"
            )


# ---- side-channel frames -------------------------------------------------------------------
# The frame version is part of every tag ("acquire/2"): a peer speaking another version gets its
# frames dropped as malformed (and counted), never misread.
FRAME_VERSION = 3
# Owner tokens: random per pull, so only the peer that acquired a lease can release it.
OWNER_BYTES = 16
# ``Granted.ready`` / ``Progress.ready`` once the prefill has finished: every layer is written.
ALL_LAYERS = -1


def _tag(kind: str) -> str:
    return f"{kind}/{FRAME_VERSION}"


class Acquire(msgspec.Struct, tag=_tag("acquire"), frozen=True):
    """Consumer → producer: pin the lease and tell me where its blocks are.

    ``remote_block_ids``: exactly the blocks of the hold (the handoff's), even when the consumer
    reads fewer (a local prefix-cache hit). ``owner``: a random token of this pull; only a
    ``Release`` carrying it ends the lease. ``readers``: how many consumer ranks will pull this
    lease (and each release it): ``planning.lease_readers`` for per-head K/V (one lease per
    producer rank); the consumer's TP size for an MLA latent, which every producer rank holds
    whole, so all consumer ranks share one lease (``LeaseTable``)."""

    transfer_id: str
    remote_block_ids: list[int]
    owner: bytes
    readers: int = 1
    incarnation: str = ""  # the handoff's ``producer_incarnation``
    # A pending handoff's acquire (no blocks, no incarnation yet): the producer answers it when
    # the lease exists, or refuses it after this long.
    wait_ms: int = 0
    # This consumer takes a grant while the prefill still computes (``Granted.ready``; a
    # producer with ``layerwise_handoff``); the rest of the layers come in ``Progress``.
    layers_ok: bool = False
    # A pending acquire: the digest of the consumer request's prompt (``prompt_digest``). The
    # producer grants only the lease of that prompt, so a transfer id used for two requests
    # never serves one the other's KV.
    prompt_digest: str = ""


class Granted(msgspec.Struct, tag=_tag("granted"), frozen=True):
    """Producer → consumer: the lease's memory, in the layout of this ``incarnation``."""

    transfer_id: str
    te_segment: str
    segments: list[MemSegment]
    incarnation: str = ""
    handoff: Handoff | None = None  # to a pending acquire: the handoff it waited for
    # ALL_LAYERS: the prefill has finished, every layer can be read. Else (a ``layers_ok``
    # acquire) a bitmask of the layers, in segment order, whose KV is written so far.
    ready: int = ALL_LAYERS
    # Each segment's layer (vLLM's layer name): a consumer whose layers differ from this
    # rank's (a pipeline-parallel stage on either side) reads the layers both hold. Empty from
    # a producer before pipeline parallel: its segments are every layer, in name order.
    layers: list[str] = []


class Refused(msgspec.Struct, tag=_tag("refused"), frozen=True):
    transfer_id: str
    reason: str


class Await(msgspec.Struct, tag=_tag("await"), frozen=True):
    """Consumer → producer, by the owner of a grant given while the prefill computes: answer
    when the ready layers differ from ``known`` (or the prefill has finished or failed), or
    after ``wait_ms``."""

    transfer_id: str
    owner: bytes
    known: int
    wait_ms: int


class Progress(msgspec.Struct, tag=_tag("progress"), frozen=True):
    """Producer → consumer: the layers ready now (``ALL_LAYERS``: the prefill has finished)."""

    transfer_id: str
    ready: int


class Release(msgspec.Struct, tag=_tag("release"), frozen=True):
    """Consumer → producer: done with the blocks (``ok`` false when the pull failed). Honoured
    only with the ``owner`` token of an ``Acquire`` of this lease."""

    transfer_id: str
    ok: bool
    owner: bytes


class Released(msgspec.Struct, tag=_tag("released"), frozen=True):
    transfer_id: str


Frame = Acquire | Granted | Refused | Release | Released | Await | Progress
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode_frame(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode_frame(data: bytes) -> Frame:
    """Raises ``msgspec.DecodeError`` (or ValidationError) on a malformed frame."""
    return _decoder.decode(data)
