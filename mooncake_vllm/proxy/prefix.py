"""Prefix-aware routing (``--policy prefix``): requests sharing a prompt prefix go to one prefill.

A prefill's vLLM keeps the KV of the prompts it computed in its prefix cache; a later prompt
starting with the same tokens reuses them instead of computing them again. Sending every request
that starts alike (a shared system prompt, the earlier turns of a chat) to the same prefill
makes those hits happen; round robin spreads them over all prefills, each computing them once.

Two pure functions, I/O-free and table-tested:

- ``prefix_key``: the leading ``PREFIX_KEY_CHARS`` characters of the prompt (or leading
  ``PREFIX_KEY_TOKENS`` token ids), as bytes, after a digest of the model the request names
  and its ``cache_salt`` (a LoRA adapter's or another tenant's KV is not reused);
- ``choose``: consistent hashing with bounded loads. Each backend owns ``VIRTUAL_NODES`` points
  on a hash ring; a key goes to the first backend clockwise from its hash that is eligible
  (healthy, not already tried) and has fewer than ``capacity`` requests in flight, where
  ``capacity = ceil(load_factor * (in flight over all eligible + 1) / eligible)``. A hot prefix
  therefore spills to the next backend on the ring once its own holds ``load_factor`` × the mean
  load, and adding or removing a backend moves only the keys it owns.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Leading characters of a text prompt that make its key: about 64 tokens (~4 characters each),
# long enough to tell system prompts apart and short enough that every turn of a chat (whose
# earlier turns are a prefix of the later ones) and every chat sharing a long system prompt
# get the same key.
PREFIX_KEY_CHARS = 256
# The same for prompts given as token ids.
PREFIX_KEY_TOKENS = 64
# Points per backend on the ring: enough that keys split about evenly between backends.
VIRTUAL_NODES = 100
# A backend takes a key's requests until it holds this many times the mean in-flight count. 2, not
# the 1.25 of the bounded-loads paper: with few prefills and few requests in flight, 1.25 spilled
# a chat's turns to the other prefill as soon as its own had 2 prefill legs running against 0
# (cap = ceil(1.25 * 3 / 2) = 2), and every spill recomputes the whole history there
# (benchmarks.prefix_routing: 72.9 % prefix-cache hits at 1.25, against 68.3 % for round robin).
DEFAULT_LOAD_FACTOR = 2.0


def _text_of(content: Any) -> str:
    """The text of a chat message's content: a string, or the text parts of a list of parts,
    each other part (an image, audio) standing as a digest of itself: vLLM's prefix cache keys
    the KV of an image's placeholder tokens by the image, so two images are two prompts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if not isinstance(part, dict):
                continue
            text = part.get("text")
            if isinstance(text, str):
                pieces.append(text)
            else:
                canonical = json.dumps(part, sort_keys=True, default=str).encode()
                pieces.append(f"\x1d{hashlib.blake2b(canonical, digest_size=8).hexdigest()}")
        return "".join(pieces)
    return ""


def prompt_identity(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The model ``body`` names and its ``cache_salt`` (None where absent or not a string):
    what keys a prompt's KV besides its tokens, as vLLM's prefix cache keys it (a LoRA adapter
    is asked for by its name)."""
    model, salt = body.get("model"), body.get("cache_salt")
    return (model if isinstance(model, str) else None, salt if isinstance(salt, str) else None)


def _identity(body: Mapping[str, Any]) -> bytes:
    """``prompt_identity`` as part of a routing key: empty for a body naming neither, else a
    16-byte digest, so the key stays bounded."""
    model, salt = prompt_identity(body)
    words = [
        f"model\x1f{model}" if model is not None else "",
        f"salt\x1f{salt}" if salt else "",
    ]
    if not any(words):
        return b""
    return hashlib.blake2b("\x1e".join(words).encode(), digest_size=16).digest()


def prefix_key(body: Mapping[str, Any], chars: int = PREFIX_KEY_CHARS) -> bytes | None:
    """The routing key of a validated completion or chat body, or None when it has no prompt:
    the model and ``cache_salt`` (``_identity``, 16 bytes), then the prompt's leading part.

    Chat messages are joined as ``role\\x1ftext\\x1e`` so that moving text from one message to
    the next changes the key (vLLM's chat template would render them differently, too).
    """
    key = _prompt_key(body, chars)
    return None if key is None else _identity(body) + key


def _prompt_key(body: Mapping[str, Any], chars: int) -> bytes | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return prompt[:chars].encode()
    if isinstance(prompt, list):  # token ids
        tokens = prompt[: max(chars // 4, 1)]
        return b"\x00ids:" + ",".join(str(t) for t in tokens).encode()
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        length = 0
        for message in messages:
            if not isinstance(message, dict):
                continue
            piece = f"{message.get('role', '')}\x1f{_text_of(message.get('content'))}\x1e"
            parts.append(piece)
            length += len(piece)
            if length >= chars or message.get("role") not in ("system", "developer"):
                break
        return "".join(parts)[:chars].encode()
    return None


def _point(data: bytes) -> int:
    # Stable across processes and restarts (Python's hash() is salted per process).
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Ring:
    """The hash ring of one pool's backends (by URL); build it again when the pool changes."""

    urls: tuple[str, ...]
    points: tuple[int, ...]  # sorted
    owners: tuple[int, ...]  # owners[i]: index into urls of the backend owning points[i]

    @classmethod
    def of(cls, urls: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> Ring:
        placed = sorted(
            (_point(f"{url}#{v}".encode()), i)
            for i, url in enumerate(urls)
            for v in range(virtual_nodes)
        )
        return cls(tuple(urls), tuple(p for p, _ in placed), tuple(i for _, i in placed))


def capacity(total_in_flight: int, eligible: int, load_factor: float) -> int:
    """Most requests a backend may hold before a key's next request spills past it."""
    return max(math.ceil(load_factor * (total_in_flight + 1) / eligible), 1)


def choose(
    ring: Ring,
    key: bytes,
    in_flight: Mapping[str, int],
    eligible: Collection[str],
    load_factor: float = DEFAULT_LOAD_FACTOR,
) -> str | None:
    """The URL that serves ``key``: the first eligible, not-full backend clockwise from its hash.

    ``in_flight`` gives each URL's requests in flight (missing: 0), ``eligible`` the URLs that
    may be chosen. None when no URL is eligible. With ``load_factor > 1`` some eligible backend
    is always below capacity (they cannot all hold more than the mean), so a key is never refused
    for load alone.
    """
    if not eligible or not ring.points:
        return None
    total = sum(in_flight.get(url, 0) for url in eligible)
    cap = capacity(total, len(eligible), load_factor)
    start = bisect.bisect(ring.points, _point(key))
    seen: set[int] = set()
    fallback: str | None = None
    count = len(ring.points)
    for step in range(count):
        owner = ring.owners[(start + step) % count]
        if owner in seen:
            continue
        seen.add(owner)
        url = ring.urls[owner]
        if url not in eligible:
            continue
        if in_flight.get(url, 0) < cap:
            return url
        fallback = fallback or url  # only reached with load_factor <= 1
        if len(seen) == len(ring.urls):
            break
    return fallback
