"""What decides a prompt's KV besides its token ids: the LoRA adapter, the multimodal inputs
behind placeholder tokens, and the request's ``cache_salt``.

vLLM's own prefix cache keys carry all three (``vllm.v1.core.kv_cache_utils``:
``generate_block_hash_extra_keys``). Every key of ours that stands for a prompt's KV must carry
them too, or two adapters, two images behind the same placeholder tokens, or two tenants with
different salts are served each other's KV. ``prompt_identity`` reads them once, at the edge,
from a vLLM ``Request`` into a frozen ``PromptIdentity``; the pool's block keys take
``block_extra_keys`` (per block, as vLLM's), the P2P lease binding takes ``identity_bytes``
(the whole prompt's). No vLLM import: a request is read by its attribute names, so stubs drive
the tests.

The LoRA adapter is named by ``(lora_name, lora_path)``, as vLLM's prefix cache names it:
``lora_int_id`` is handed out per engine in load order, so the same id means different adapters
on two engines of one pool; the path makes a name re-pointed at another adapter a new key. A
content hash of the adapter's weights would be stronger but the scheduler process never reads
them (the workers do, from a path that may be a hub id), and hashing them on the lookup path
would stall every step. The cost of that choice: an adapter whose files are replaced in place
(``load_inplace``) under the same name and path keeps its old keys; publish a new version under
a new path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MMSpan:
    """One multimodal input: its hash (``MultiModalFeatureSpec.identifier``, which carries the
    LoRA prefix where the adapter changes the encoder) and its placeholder tokens' span."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class PromptIdentity:
    """``lora``: ``(lora_name, lora_path)`` or None; ``mm``: the inputs sorted by offset, as vLLM
    keeps them; ``cache_salt``: "" when the request has none."""

    lora: tuple[str, str] | None = None
    mm: tuple[MMSpan, ...] = ()
    cache_salt: str = ""

    @property
    def is_plain(self) -> bool:
        """Tokens alone decide the KV: every key is what it was before identities existed."""
        return self.lora is None and not self.mm and not self.cache_salt


PLAIN = PromptIdentity()


def prompt_identity(request: Any) -> PromptIdentity | None:
    """The identity of a vLLM ``Request`` (or anything with its ``lora_request``,
    ``mm_features``, ``cache_salt``, ``prompt_embeds``). None when token ids do not decide the
    prompt at all (prompt embeddings: the ids at their positions are placeholders), so no key
    may be made of them."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    spans = tuple(
        MMSpan(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
        for f in getattr(request, "mm_features", None) or ()
    )
    return PromptIdentity(
        lora=(str(lora.lora_name), str(lora.lora_path or "")) if lora else None,
        mm=tuple(sorted(spans, key=lambda s: s.offset)),
        cache_salt=getattr(request, "cache_salt", None) or "",
    )


def _encode(keys: list[list[Any]]) -> bytes:
    # JSON of strings and ints is canonical and self-delimiting: two key lists encode alike
    # exactly when they are equal.
    return json.dumps(keys, separators=(",", ":"), ensure_ascii=True).encode() if keys else b""


def block_extra_keys(identity: PromptIdentity, start: int, end: int) -> bytes:
    """What block ``[start, end)`` of the prompt adds to its token ids, as vLLM's
    ``generate_block_hash_extra_keys``: the adapter on every block, each multimodal input that
    overlaps the block with its offset from the block's start (negative where it began in an
    earlier block), the salt on the first block only (the chain carries it on). ``b""`` when
    nothing applies."""
    keys: list[list[Any]] = []
    if identity.lora is not None:
        keys.append(["lora", *identity.lora])
    keys += [
        ["mm", s.identifier, s.offset - start]
        for s in identity.mm
        if s.offset < end and start < s.offset + s.length
    ]
    if start == 0 and identity.cache_salt:
        keys.append(["cache_salt", identity.cache_salt])
    return _encode(keys)


def identity_bytes(identity: PromptIdentity | None) -> bytes:
    """The whole prompt's identity, for a binding that is not per block (a P2P lease's
    ``prompt_digest``): ``b""`` for a plain prompt, so such a binding stays as it was."""
    if identity is None or identity.is_plain:
        return b""
    keys: list[list[Any]] = []
    if identity.lora is not None:
        keys.append(["lora", *identity.lora])
    keys += [["mm", s.identifier, s.offset, s.length] for s in identity.mm]
    if identity.cache_salt:
        keys.append(["cache_salt", identity.cache_salt])
    return _encode(keys)


def request_identity(request: Any) -> bytes:
    """``identity_bytes`` of a vLLM ``Request``: what ``prompt_digest`` must hash beside the
    token ids so that one transfer id used for two requests with the same tokens but another
    adapter, other images or another salt is refused. Prompt embeddings are not covered (their
    prompts have no ids to bind today)."""
    return identity_bytes(prompt_identity(request))
