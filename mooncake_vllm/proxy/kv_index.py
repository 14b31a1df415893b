"""What each engine's prefix cache holds, learned from its KV events (``--policy kv``).

vLLM publishes, per engine, a ``BlockStored`` event when a full block of KV enters its prefix
cache (with the block's token ids and vLLM's block hash), ``BlockRemoved`` when it is evicted
and ``AllBlocksCleared`` when the cache is reset (``--kv-events-config``; see
``kv_events.EventSubscriber`` for the wire). The proxy cannot recompute vLLM's block hashes
(they are seeded per process), so this index keys a block by its own chain hash over token
blocks (``block_keys``: a block's key covers its tokens and every token before it, as vLLM's
does) and remembers, per engine, which vLLM hash stands for which key, for ``BlockRemoved``.

Pure and I/O-free, table-tested:

- ``KvEvent``: the three events as msgspec types (``decode_event`` from msgpack,
  ``parse_event`` from a dict), validated: a malformed event is a ``BadEvent``, never an index
  half-updated;
- ``block_keys``: the chained keys of a token sequence's full blocks;
- ``KvIndex``: events in (``apply``), per engine the prompt tokens its cache holds as a leading
  run of blocks out (``matched_tokens``);
- ``costs`` / ``choose``: the cost model (the comment above ``SHARE_WEIGHT``; docs/proxy.md): per
  engine below the bounded-loads cap (``prefix.capacity``), the tokens it must compute or pull
  plus the tokens already queued there plus a charge for its excess share of the pool's recent
  picks; the least wins. Without the prompt's ids (no tokenizer yet): the longest cached prefix
  if any, else the hash ring on the prompt's prefix key (``prefix.choose``).

A block is a hit only while the engine still holds every block before it (vLLM evicts a
chain's tail first, and its prefix-cache lookup stops at the first miss), so the match is the
leading run of keys the engine holds, not a count of keys anywhere in the prompt.

Each engine's part is bounded (``MAX_BLOCKS_PER_ENGINE`` vLLM hashes): past it, the block
stored or reported longest ago is forgotten first (``EngineCache.evicted_blocks``), as vLLM's
own LRU would have evicted it first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from mooncake_vllm.proxy import prefix

# The chain's root: the "parent" of a prompt's first block.
ROOT_KEY = 0

# The vLLM hashes one engine's part of the index remembers; past it the oldest is forgotten.
# An engine's prefix cache holds far fewer blocks (an 80 GB GPU: some 10^5 blocks of 16
# tokens); at ~250 B a hash this caps an engine's part near 256 MiB.
MAX_BLOCKS_PER_ENGINE = 1 << 20

# The longest LoRA name or cache_salt an identity takes, and how many adapter names the index
# remembers having seen (a request naming one of them is matched against that adapter's chain).
MAX_NAME = 1024
MAX_LORA_NAMES = 4096

# ---- the events, as vLLM publishes them (vllm.distributed.kv_events) ---------------------------
# A block hash: vLLM's ExternalBlockHash.
BlockHash = bytes | int
# A token id, as ``_chain`` packs it (a signed 64-bit int; vocabularies are far smaller).
TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class BlockStored(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    """Full blocks entered the engine's prefix cache (or were hit again)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[TokenId]
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    group_idx: int | None = None
    # What keys the blocks besides their tokens (vLLM >= 0.32): the LoRA adapter's name, and per
    # block the untagged extra keys of its hash (the adapter's name if any, then multimodal
    # (identifier, offset) pairs, then the request's cache_salt on a prompt's first block).
    lora_name: Annotated[str, msgspec.Meta(max_length=MAX_NAME)] | None = None
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    """Blocks were evicted from the engine's prefix cache."""

    block_hashes: list[BlockHash]
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    """The engine's prefix cache was reset."""


# vLLM's other fields (medium, ...) are ignored; an event of another
# type is a ``BadEvent`` with ``reason`` "unknown_type".
KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
KNOWN_EVENT_TYPES = frozenset(t.__name__ for t in (BlockStored, BlockRemoved, AllBlocksCleared))


class BadEvent(ValueError):
    """An event we cannot apply. ``reason``: "unknown_type" (a type this proxy does not know:
    harmless, skipped) or "invalid" (a known type whose fields are wrong: what it meant for
    the index is lost)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class _Tagged(msgspec.Struct):
    type: str


_event_decoder = msgspec.msgpack.Decoder(KvEvent)
_tag_decoder = msgspec.msgpack.Decoder(_Tagged)


def _bad(e: msgspec.MsgspecError, tag: Any) -> BadEvent:
    if isinstance(tag, str) and tag not in KNOWN_EVENT_TYPES:
        return BadEvent("unknown_type", f"type {tag[:64]!r}")
    return BadEvent("invalid", str(e))


def decode_event(data: bytes) -> KvEvent:
    """One event as msgpack encodes it (a map tagged ``type``); raises ``BadEvent``."""
    try:
        return _event_decoder.decode(data)
    except msgspec.MsgspecError as e:
        try:
            tag = _tag_decoder.decode(data).type
        except msgspec.MsgspecError:
            tag = None
        raise _bad(e, tag) from None


def parse_event(event: Mapping[str, Any]) -> KvEvent:
    """One event as a dict (``decode_event``'s map); raises ``BadEvent``."""
    try:
        return msgspec.convert(event, KvEvent)
    except msgspec.MsgspecError as e:
        raise _bad(e, event.get("type")) from None


def _chain(parent: int, tokens: Sequence[int]) -> int:
    data = parent.to_bytes(8, "big") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def root_key(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The "parent" of a prompt's first block: ``ROOT_KEY``, or for a prompt of a LoRA adapter
    or with a ``cache_salt`` (which vLLM's prefix cache keys apart) a key of its own."""
    if not lora_name and not cache_salt:
        return ROOT_KEY
    data = f"lora\x1f{lora_name or ''}\x1esalt\x1f{cache_salt or ''}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _salt_of(event: BlockStored) -> str | None:
    """The cache_salt among the first block's extra keys: the first string after the adapter's
    name (multimodal entries are pairs)."""
    keys = event.extra_keys[0] if event.extra_keys else None
    if not keys:
        return None
    rest = keys[1:] if event.lora_name and keys and keys[0] == event.lora_name else keys
    salt = next((k for k in rest if isinstance(k, str)), None)
    return salt[:MAX_NAME] if salt else None


def block_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """The chained keys of the full blocks of ``token_ids`` (a trailing partial block has none:
    vLLM caches full blocks only). ``parent``: the key of the block before the first one."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _chain(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass
class EngineCache:
    """One engine's cached blocks, as its events told them."""

    block_size: int | None = None  # learned from its first BlockStored
    # vLLM's hash of each block it holds → our key (for BlockRemoved, and as a later block's
    # parent in BlockStored), the block stored or reported longest ago first.
    key_of: dict[BlockHash, int] = field(default_factory=dict)
    # Our key → how many of the engine's vLLM hashes stand for it (a cache_salt or LoRA gives
    # the same tokens a second vLLM hash).
    held: dict[int, int] = field(default_factory=dict)
    # Blocks we could not key: their parent was not known (its event came before we listened).
    unchained_blocks: int = 0
    # Blocks forgotten to keep ``key_of`` within the index's bound.
    evicted_blocks: int = 0

    def clear(self) -> None:
        self.key_of.clear()
        self.held.clear()

    def forget(self, vllm_hash: BlockHash) -> None:
        """The engine no longer holds ``vllm_hash`` (or we no longer remember it)."""
        key = self.key_of.pop(vllm_hash, None)
        if key is None:
            return
        left = self.held.get(key, 0) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)


class KvIndex:
    """Per engine (by backend URL), the blocks its prefix cache holds."""

    def __init__(self, max_blocks_per_engine: int = MAX_BLOCKS_PER_ENGINE) -> None:
        if max_blocks_per_engine <= 0:
            raise ValueError(f"max_blocks_per_engine={max_blocks_per_engine}: must be > 0")
        self.engines: dict[str, EngineCache] = {}
        self.max_blocks_per_engine = max_blocks_per_engine
        # Adapter names seen in events: a request's model that is one of them asks for its KV.
        self.lora_names: dict[str, None] = {}

    def engine(self, url: str) -> EngineCache:
        return self.engines.setdefault(url, EngineCache())

    def clear(self, url: str) -> None:
        """Forget what ``url`` holds (its cache was reset, it restarted, or events were lost)."""
        self.engine(url).clear()

    def cached_blocks(self, url: str) -> int:
        """How many distinct token blocks ``url``'s cache holds, as its events told."""
        cache = self.engines.get(url)
        return 0 if cache is None else len(cache.held)

    def apply(self, url: str, event: KvEvent | Mapping[str, Any]) -> None:
        """One KV event from ``url``'s engine: typed (``decode_event``), or a dict of the same
        fields, validated here (``parse_event``; ``BadEvent`` before anything changes)."""
        if not isinstance(event, KvEvent):
            event = parse_event(event)
        cache = self.engine(url)
        if isinstance(event, AllBlocksCleared):
            cache.clear()
        elif event.group_idx not in (None, 0):
            return  # only the first KV cache group (a hybrid model's others cover the same tokens)
        elif isinstance(event, BlockRemoved):
            for vllm_hash in event.block_hashes:
                cache.forget(vllm_hash)
        else:
            self._stored(cache, event)

    def _stored(self, cache: EngineCache, event: BlockStored) -> None:
        hashes, tokens, block_size = event.block_hashes, event.token_ids, event.block_size
        if not hashes:
            return
        if len(tokens) != block_size * len(hashes):
            return  # not whole blocks of this size (a hybrid model's partial hash block)
        if cache.block_size is None:
            cache.block_size = block_size
        elif cache.block_size != block_size:
            return
        if event.lora_name:
            self.lora_names[event.lora_name] = None
            while len(self.lora_names) > MAX_LORA_NAMES:
                del self.lora_names[next(iter(self.lora_names))]
        if event.parent_block_hash is None:
            parent = root_key(event.lora_name, _salt_of(event))
        else:
            known = cache.key_of.get(event.parent_block_hash)
            if known is None:
                cache.unchained_blocks += len(hashes)
                return
            parent = known
        for vllm_hash, key in zip(hashes, block_keys(tokens, block_size, parent), strict=True):
            if vllm_hash in cache.key_of:
                # A prefix-cache hit reported again: already counted; now the newest.
                cache.key_of[vllm_hash] = cache.key_of.pop(vllm_hash)
                continue
            cache.key_of[vllm_hash] = key
            cache.held[key] = cache.held.get(key, 0) + 1
        while len(cache.key_of) > self.max_blocks_per_engine:
            cache.forget(next(iter(cache.key_of)))
            cache.evicted_blocks += 1

    def matched_tokens(
        self,
        token_ids: Sequence[int],
        urls: Iterable[str],
        model: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, int]:
        """Per URL, how many leading tokens of ``token_ids`` its cache holds (whole blocks),
        for a request naming ``model`` (an adapter, if the index has seen its name in an event)
        with ``cache_salt``."""
        lora = model if model in self.lora_names else None
        root = root_key(lora, cache_salt[:MAX_NAME] if cache_salt else None)
        keys_by_size: dict[int, list[int]] = {}
        out: dict[str, int] = {}
        for url in urls:
            cache = self.engines.get(url)
            if cache is None or cache.block_size is None or not cache.held:
                out[url] = 0
                continue
            size = cache.block_size
            keys = keys_by_size.get(size)
            if keys is None:
                keys = keys_by_size[size] = block_keys(token_ids, size, root)
            run = 0
            for key in keys:
                if key not in cache.held:
                    break
                run += 1
            out[url] = run * size
        return out


# The cost model of ``--policy kv`` (docs/proxy.md#the-cost-model), in prompt tokens, the same
# for a prefill and a decode leg: an engine's cost for a request of P tokens is
#
#     miss + QUEUE_WEIGHT[pool] x queued + SHARE_WEIGHT x max(excess, 0) x P
#
# - miss: P minus the tokens its cache holds (``KvIndex.matched_tokens``): what it must compute
#   (a prefill) or pull (a decode) for this request;
# - queued: the misses of the legs the proxy has in flight on it, the work it must do first (a
#   prefill's queue; a decode's pulls);
# - excess: its share of the pool's last ``RECENT_PICKS`` picks over the fair share, ``s x n -
#   1`` for share s of n engines: the load that never shows in flight at low concurrency (two
#   chats at a time never overlap a prefill leg) and would otherwise send every chat under one
#   system prompt after the first.
#
# SHARE_WEIGHT 2.5 from ``benchmarks.kv_routing_sim`` (this router on kv_routing's workload, 20
# seeds, both roles): 1.050x the reuse bound on average and at most 59 % of the requests on one
# engine; 2 gave 1.032x and 62 %, 4 gave 1.085x and 56 %. With two engines a later turn whose
# system prompt is on both (it gives up its own ~15 %) moves at ~53 % share, a new chat that
# would recompute its system prompt elsewhere (~70 % of its first prompt) at ~64 %.
SHARE_WEIGHT = 2.5
# What a token queued ahead costs, per pool. A prefill: a tenth of a token of its own: the queue
# is this request's wait alone and drains at the engine's batch speed, while a token it
# recomputes elsewhere (history it leaves behind) is work the whole pool pays for, now and when
# the chat's next turn finds its history split (``benchmarks.trace``, 2P2D, eight conversations
# at a time: weight 1 computed 1.12x the bound, 0.5 1.05-1.11x, 0.25 1.06x, 0.1 1.04x with the
# TTFT p50 halved against 0.25, the share term still spreading load to at most 52 %). A decode:
# nothing: its legs' pulls run beside its running requests rather than ahead of the next one,
# and what slows a decode (its batch) is what bounded loads and the share see; charged at 0.5
# it moved turns off their history for pulls soon done (1.13x the least pulled at eight).
QUEUE_WEIGHT = {"prefill": 0.1, "decode": 0.0}
# The pool's last picks that make an engine's recent share (``BackendPool``), and how many
# there must be before a share is judged at all.
RECENT_PICKS = 64
MIN_RECENT_PICKS = 8


@dataclass(frozen=True)
class Cost:
    """One engine's cost for one request (the model above), its terms kept for /health and
    the tests."""

    url: str
    miss: int
    queued: float  # QUEUE_WEIGHT x the tokens queued there
    share: float  # SHARE_WEIGHT x max(excess, 0) x P

    @property
    def total(self) -> float:
        return self.miss + self.queued + self.share


def costs(
    prompt_tokens: int,
    matched_tokens: Mapping[str, int],
    queued_tokens: Mapping[str, int],
    recent_picks: Mapping[str, int],
    urls: Sequence[str],
    queue_weight: float = QUEUE_WEIGHT["prefill"],
) -> list[Cost]:
    """The cost of each of ``urls`` for a request of ``prompt_tokens`` (missing entries: 0),
    queued tokens weighed ``queue_weight`` (the pool's ``QUEUE_WEIGHT``). The share term is 0
    until the pool has ``MIN_RECENT_PICKS`` picks, and with a single URL."""
    picks = sum(recent_picks.get(url, 0) for url in urls)
    judged = picks >= MIN_RECENT_PICKS and len(urls) > 1
    out = []
    for url in urls:
        excess = recent_picks.get(url, 0) / picks * len(urls) - 1 if judged else 0.0
        miss = max(prompt_tokens - matched_tokens.get(url, 0), 0)
        share = SHARE_WEIGHT * max(excess, 0.0) * prompt_tokens
        out.append(Cost(url, miss, queue_weight * queued_tokens.get(url, 0), share))
    return out


def choose(
    matched_tokens: Mapping[str, int],
    in_flight: Mapping[str, int],
    eligible: Sequence[str],
    ring: prefix.Ring,
    key: bytes | None,
    load_factor: float = prefix.DEFAULT_LOAD_FACTOR,
    *,
    recent_picks: Mapping[str, int] | None = None,
    prompt_tokens: int = 0,
    queued_tokens: Mapping[str, int] | None = None,
    queue_weight: float = QUEUE_WEIGHT["prefill"],
) -> str | None:
    """The URL for a request: the least cost (above), bounded by load.

    ``eligible`` in the caller's preference order (round robin), ``in_flight`` per URL (missing:
    0), ``matched_tokens`` per URL (missing: 0). In two steps:

    1. A URL holding ``load_factor`` x the mean in flight (``prefix.capacity``) is passed over,
       as under ``--policy prefix``: bounded loads, whatever the costs say.
    2. With the prompt's length known (``prompt_tokens`` > 0, its ids were matched): the least
       ``Cost.total``; equal costs to the fewest in flight, then the ring's choice for ``key``
       among them (so equal prompts sent together agree), then the caller's order. Without it
       (no ids: nothing was matched): the longest cached prefix, else ``prefix.choose`` on
       ``key`` (the ring), or, without a key, the fewest in flight.

    None when nothing is eligible.
    """
    if not eligible:
        return None
    total = sum(in_flight.get(url, 0) for url in eligible)
    cap = prefix.capacity(total, len(eligible), load_factor)
    below = [url for url in eligible if in_flight.get(url, 0) < cap] or list(eligible)
    if prompt_tokens > 0:
        queued, recent = queued_tokens or {}, recent_picks or {}
        ranked = costs(prompt_tokens, matched_tokens, queued, recent, below, queue_weight)
        least = min(c.total for c in ranked)
        tied = [c.url for c in ranked if c.total == least]
        fewest = min(in_flight.get(url, 0) for url in tied)
        tied = [url for url in tied if in_flight.get(url, 0) == fewest]
        if len(tied) > 1 and key is not None:
            return prefix.choose(ring, key, in_flight, tied, load_factor)
        return tied[0]
    best = max(matched_tokens.get(url, 0) for url in below)
    if best > 0:
        holders = [url for url in below if matched_tokens.get(url, 0) == best]
        # min() keeps the first of equals: the caller's order.
        return min(holders, key=lambda url: in_flight.get(url, 0))
    if key is not None:
        return prefix.choose(ring, key, in_flight, eligible, load_factor)
    return min(eligible, key=lambda url: in_flight.get(url, 0))


def prompt_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids when the client sent them (a completion's ``prompt`` as ids, or a
    batch's first prompt); None for text and chat, which route by ``prefix.prefix_key``."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None
