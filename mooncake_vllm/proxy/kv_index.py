"""What each engine's prefix cache holds, learned from its KV events (``--policy kv``).

vLLM publishes, per engine, a ``BlockStored`` event when a full block of KV enters its prefix
cache (with the block's token ids and vLLM's block hash), ``BlockRemoved`` when it is evicted
and ``AllBlocksCleared`` when the cache is reset (``--kv-events-config``; see
``kv_events.EventSubscriber`` for the wire). The proxy cannot recompute vLLM's block hashes
(they are seeded per process), so this index keys a block by its own chain hash over token
blocks (``block_keys``: a block's key covers its tokens and every token before it, as vLLM's
does) and remembers, per engine, which vLLM hash stands for which key, for ``BlockRemoved``.

Pure and I/O-free, table-tested:

- ``block_keys``: the chained keys of a token sequence's full blocks;
- ``KvIndex``: events in (``apply``), per engine the prompt tokens its cache holds as a leading
  run of blocks out (``matched_tokens``);
- ``choose``: the engine with the longest cached prefix among those below the bounded-loads
  cap (``prefix.capacity``), ties to the fewest in flight; with no engine holding a block of
  the prompt, today's estimate (``prefix.choose``, the hash ring on the prompt's prefix key);
  an engine with more than its share of the recent requests gives a request up to a less-used
  one when the cached tokens lost there are few enough for its excess (``SHARE_WEIGHT``).

A block is a hit only while the engine still holds every block before it (vLLM evicts a
chain's tail first, and its prefix-cache lookup stops at the first miss), so the match is the
leading run of keys the engine holds, not a count of keys anywhere in the prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_vllm.proxy import prefix

# The chain's root: the "parent" of a prompt's first block.
ROOT_KEY = 0


def _chain(parent: int, tokens: Sequence[int]) -> int:
    data = parent.to_bytes(8, "big") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


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
    # parent in BlockStored).
    key_of: dict[Hashable, int] = field(default_factory=dict)
    # Our key → how many of the engine's vLLM hashes stand for it (a cache_salt or LoRA gives
    # the same tokens a second vLLM hash).
    held: dict[int, int] = field(default_factory=dict)
    # Blocks we could not key: their parent was not known (its event came before we listened).
    unchained_blocks: int = 0

    def clear(self) -> None:
        self.key_of.clear()
        self.held.clear()


class KvIndex:
    """Per engine (by backend URL), the blocks its prefix cache holds."""

    def __init__(self) -> None:
        self.engines: dict[str, EngineCache] = {}

    def engine(self, url: str) -> EngineCache:
        return self.engines.setdefault(url, EngineCache())

    def clear(self, url: str) -> None:
        """Forget what ``url`` holds (its cache was reset, it restarted, or events were lost)."""
        self.engine(url).clear()

    def cached_blocks(self, url: str) -> int:
        """How many distinct token blocks ``url``'s cache holds, as its events told."""
        cache = self.engines.get(url)
        return 0 if cache is None else len(cache.held)

    def apply(self, url: str, event: Mapping[str, Any]) -> None:
        """One KV event from ``url``'s engine, as msgpack decodes it (a dict with ``type``)."""
        kind = event.get("type")
        cache = self.engine(url)
        if kind == "AllBlocksCleared":
            cache.clear()
        elif kind == "BlockRemoved":
            if event.get("group_idx") not in (None, 0):
                return
            for vllm_hash in event.get("block_hashes") or ():
                key = cache.key_of.pop(_hashable(vllm_hash), None)
                if key is None:
                    continue
                left = cache.held.get(key, 0) - 1
                if left > 0:
                    cache.held[key] = left
                else:
                    cache.held.pop(key, None)
        elif kind == "BlockStored":
            self._stored(cache, event)

    def _stored(self, cache: EngineCache, event: Mapping[str, Any]) -> None:
        # Only the first KV cache group (a hybrid model's others cover the same tokens).
        if event.get("group_idx") not in (None, 0):
            return
        hashes = [_hashable(h) for h in event.get("block_hashes") or ()]
        tokens = event.get("token_ids") or []
        block_size = event.get("block_size")
        if not hashes or not isinstance(block_size, int) or block_size <= 0:
            return
        if len(tokens) != block_size * len(hashes):
            return  # not whole blocks of this size (a hybrid model's partial hash block)
        if cache.block_size is None:
            cache.block_size = block_size
        elif cache.block_size != block_size:
            return
        parent_hash = event.get("parent_block_hash")
        if parent_hash is None:
            parent = ROOT_KEY
        else:
            known = cache.key_of.get(_hashable(parent_hash))
            if known is None:
                cache.unchained_blocks += len(hashes)
                return
            parent = known
        for vllm_hash, key in zip(hashes, block_keys(tokens, block_size, parent), strict=True):
            if vllm_hash in cache.key_of:
                continue  # a prefix-cache hit reported again: already counted
            cache.key_of[vllm_hash] = key
            cache.held[key] = cache.held.get(key, 0) + 1

    def matched_tokens(self, token_ids: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        """Per URL, how many leading tokens of ``token_ids`` its cache holds (whole blocks)."""
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
                keys = keys_by_size[size] = block_keys(token_ids, size)
            run = 0
            for key in keys:
                if key not in cache.held:
                    break
                run += 1
            out[url] = run * size
        return out


def _hashable(vllm_hash: Any) -> Hashable:
    # vLLM's ExternalBlockHash is bytes or int; msgpack may hand a list for other encodings.
    return tuple(vllm_hash) if isinstance(vllm_hash, list) else vllm_hash


# How much recompute a request may be sent to (its cached tokens given up, as a fraction of its
# prompt) per unit of its engine's excess share of the pool's recent requests: an engine at
# share s of n engines has excess ``s * n - 1``. With two engines, a later turn whose system
# prompt is on both (it gives up its own ~15 %) moves at ~53 % share, a new chat that would
# recompute its system prompt elsewhere (~70 % of its first prompt) at ~64 %, an uncached prompt
# (nothing to give up) at any excess. 2.5 from ``benchmarks.kv_routing_sim`` (this router on
# kv_routing's workload, 20 seeds, both roles): 1.050x the reuse bound on average and at most
# 59 % of the requests on one engine; 2 gave 1.032x and 62 %, 4 gave 1.085x and 56 %.
SHARE_WEIGHT = 2.5
# The pool's last picks that make an engine's recent share (``BackendPool``), and how many
# there must be before a share is judged at all.
RECENT_PICKS = 64
MIN_RECENT_PICKS = 8


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
) -> str | None:
    """The URL for a request: the longest cached prefix, weighed against load.

    ``eligible`` in the caller's preference order (round robin), ``in_flight`` per URL (missing:
    0), ``matched_tokens`` per URL (missing: 0). In three steps:

    1. A URL holding ``load_factor`` × the mean in flight (``prefix.capacity``) is passed over,
       as under ``--policy prefix``.
    2. The longest cached prefix wins, ties to the fewest in flight, then the fewest recent
       picks. When no URL holds a block of the prompt: ``prefix.choose`` on ``key`` (the
       ring), or, without a key, the fewest in flight.
    3. Share: at low concurrency nothing is ever in flight enough for step 1, and every chat
       under one system prompt would follow its first. So when the winner has more than its
       fair share of ``recent_picks`` (per URL, the pool's last ``RECENT_PICKS`` choices), the
       request goes to the less-used URL holding the most of it, if the tokens it gives up
       there are at most ``SHARE_WEIGHT`` × the winner's excess share × ``prompt_tokens``.
       Without ``prompt_tokens`` (the ids are not known) this step is skipped.

    None when nothing is eligible.
    """
    if not eligible:
        return None
    recent = recent_picks or {}
    total = sum(in_flight.get(url, 0) for url in eligible)
    cap = prefix.capacity(total, len(eligible), load_factor)
    below = [url for url in eligible if in_flight.get(url, 0) < cap] or list(eligible)
    best = max(matched_tokens.get(url, 0) for url in below)
    if best > 0:
        holders = [url for url in below if matched_tokens.get(url, 0) == best]
        # min() keeps the first of equals: the caller's order.
        chosen = min(holders, key=lambda url: (in_flight.get(url, 0), recent.get(url, 0)))
    elif key is not None:
        chosen = prefix.choose(ring, key, in_flight, eligible, load_factor)
        assert chosen is not None
    else:
        chosen = min(eligible, key=lambda url: in_flight.get(url, 0))
    picks = sum(recent.get(url, 0) for url in eligible)
    if prompt_tokens <= 0 or picks < MIN_RECENT_PICKS or len(eligible) < 2:
        return chosen
    excess = recent.get(chosen, 0) / picks * len(eligible) - 1
    if excess <= 0:
        return chosen
    others = [url for url in below if recent.get(url, 0) < recent.get(chosen, 0)]
    if not others:
        return chosen
    alt = max(others, key=lambda url: (matched_tokens.get(url, 0), -recent.get(url, 0)))
    given_up = matched_tokens.get(chosen, 0) - matched_tokens.get(alt, 0)
    return alt if given_up <= SHARE_WEIGHT * excess * prompt_tokens else chosen


def prompt_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids when the client sent them (a completion's ``prompt`` as ids, or a
    batch's first prompt); None for text and chat, which route by ``prefix.prefix_key``."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None
