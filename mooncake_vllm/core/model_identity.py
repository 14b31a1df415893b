"""Which model an engine serves, as one string for the compatibility check.

Two engines of the same shape (architecture, layers, heads, dtypes, block size) lay their KV out
alike, so a raw block copy between them succeeds; but KV computed with other weights (a
fine-tune of the same base) decodes into a fluent, wrong answer. ``engine_compat_hash`` therefore
also covers the model's identity, which is (first match wins):

1. the ``model_identity`` setting, verbatim: a name the operator declares on both sides, for the
   same weights stored differently (another format, a re-saved config.json, other shard sizes);
2. the fingerprint of the model's local files (``fingerprint_model``): the model directory, a
   single weight file (GGUF), or for a hub name the local snapshot vLLM downloaded;
3. the hub name and revision (``name@revision``) when no local files are found.

The fingerprint is sha256 over config.json's bytes and, for each weight file (sorted by name),
its name, its size and sampled bytes. Weight files are the top-level ``*.safetensors`` (what vLLM
loads when there are any), else ``*.bin``, ``*.pt`` and ``*.pth``. A safetensors file is sampled
per tensor: its header (every tensor's name, dtype, shape and offsets) and ``TENSOR_SAMPLE_BYTES``
from the middle of each tensor (at most ``MAX_TENSORS_PER_FILE`` tensors, evenly spread); any
other weight file at its start, middle and end, ``RANGE_SAMPLE_BYTES`` each. So a model of any
size costs a few MiB of reads per file, mostly from the page cache vLLM has just filled.

What it catches: any change of config.json; a weight file added, removed, renamed or resized;
in safetensors, any tensor whose values changed (a full fine-tune, a merged LoRA, a few unfrozen
layers): a changed tensor keeps all its sampled bytes only with negligible probability.
What it does not catch: a safetensors change that spares every tensor's sample (a few edited
rows); in the other formats, a change outside the three sampled ranges (a partial fine-tune saved
as ``*.bin`` can be missed: declare ``model_identity`` there); anything outside the model's own
files (LoRA adapters loaded per request, a tokenizer or chat template that differs). The same
weights stored differently get different fingerprints: declare ``model_identity`` on both sides.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# Bytes read from the middle of each safetensors tensor (a few hundred values).
TENSOR_SAMPLE_BYTES = 1024
# Tensors sampled per safetensors file, at most (evenly spread over the file's tensors).
MAX_TENSORS_PER_FILE = 4096
# Bytes read at the start, middle and end of any other weight file.
RANGE_SAMPLE_BYTES = 1 << 20
# The safetensors format's own header limit; a larger one is not a safetensors header.
_MAX_SAFETENSORS_HEADER_BYTES = 100 << 20
_FINGERPRINT_VERSION = b"mooncake-vllm model fingerprint 1"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def model_identity(
    model: str,
    revision: str | None = None,
    declared: str | None = None,
    *,
    snapshot: Callable[[str, str | None], Path | None] | None = None,
) -> str:
    """The identity of ``model`` (vLLM's ``--model``: a path or a hub name) at ``revision``:
    ``declared`` when given, else the fingerprint of its local files, else ``name@revision``.

    ``snapshot(model, revision)``: where a hub model's files are on this machine (None: not
    there); by default ``hub_snapshot``."""
    if declared:
        return declared
    local: Path | None = Path(model)
    if not local.exists():
        local = (snapshot or hub_snapshot)(model, revision)
    fingerprint = fingerprint_model(local) if local is not None else None
    if fingerprint is not None:
        return fingerprint
    return f"{model}@{revision}" if revision else model


def short_identity(identity: str) -> str:
    """For messages: a fingerprint's first 12 hex digits, any other identity as it is."""
    return identity[:12] if _SHA256_HEX.fullmatch(identity) else identity


def hub_snapshot(model: str, revision: str | None, cache_dir: str | None = None) -> Path | None:
    """The local snapshot directory of hub model ``model`` at ``revision`` (the default branch
    when None), if Hugging Face's cache holds its config.json; never goes to the network."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", cache_dir=cache_dir, revision=revision)
    except Exception:  # not a repo id (an absolute path, a URI), or no huggingface_hub
        return None
    return Path(found).parent if isinstance(found, str) else None


def fingerprint_model(path: Path) -> str | None:
    """sha256 (hex) of a model directory's config.json and weight files, or of one weight file;
    None when ``path`` holds neither."""
    if path.is_file():
        config, files = None, [path]
    elif path.is_dir():
        config, files = path / "config.json", weight_files(path)
        if not config.is_file():
            config = None
    else:
        return None
    if config is None and not files:
        return None
    digest = hashlib.sha256(_FINGERPRINT_VERSION)
    if config is not None:
        _add(digest, b"config.json", config.read_bytes())
    for file in files:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _add(digest, file.name.encode(), str(size).encode())
            for offset, length in _sample_ranges(f, size):
                f.seek(offset)
                _add(digest, str(offset).encode(), f.read(length))
    return digest.hexdigest()


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files vLLM would load from ``model_dir``'s top level, sorted by name."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    safetensors = [p for p in files if p.suffix == ".safetensors"]
    return safetensors or [p for p in files if p.suffix in (".bin", ".pt", ".pth")]


def _add(digest, name: bytes, data: bytes) -> None:
    """Length-prefixed, so no two different sequences of fields hash alike."""
    for part in (name, data):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)


def _sample_ranges(f: BinaryIO, size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the bytes of an open weight file that go into the fingerprint."""
    return _safetensors_ranges(f, size) or _spread_ranges(size)


def _safetensors_ranges(f: BinaryIO, size: int) -> list[tuple[int, int]] | None:
    """The header, then ``TENSOR_SAMPLE_BYTES`` from the middle of each tensor's data; None when
    the file does not start with a safetensors header (then it is sampled as any other file)."""
    header_len = int.from_bytes(f.read(8), "little")
    if not 2 <= header_len <= min(size - 8, _MAX_SAFETENSORS_HEADER_BYTES):
        return None
    try:
        header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        tensors = sorted(
            (data_start + int(t["data_offsets"][0]), data_start + int(t["data_offsets"][1]))
            for name, t in header.items()
            if name != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    step = -(-len(tensors) // MAX_TENSORS_PER_FILE) or 1
    ranges = [(0, data_start)]
    for begin, end in tensors[::step]:
        length = max(0, min(TENSOR_SAMPLE_BYTES, end - begin))
        ranges.append((begin + (end - begin - length) // 2, length))
    return ranges


def _spread_ranges(size: int) -> list[tuple[int, int]]:
    n = RANGE_SAMPLE_BYTES
    if size <= 3 * n:
        return [(0, size)]
    return [(0, n), ((size - n) // 2, n), (size - n, n)]


def engine_model_identity(vllm_config: VllmConfig, declared: str | None) -> str:
    """The identity of the model this engine serves (``declared``: the ``model_identity``
    setting). Computed once per process: the scheduler half and every worker rank each need it
    for the compat hash, and get the same."""
    mc = vllm_config.model_config
    load_config = getattr(vllm_config, "load_config", None)
    download_dir = getattr(load_config, "download_dir", None)
    return _engine_identity(mc.model, mc.revision, declared, download_dir)


@functools.cache
def _engine_identity(
    model: str, revision: str | None, declared: str | None, download_dir: str | None
) -> str:
    t0 = time.monotonic()
    snapshot = functools.partial(hub_snapshot, cache_dir=download_dir)
    identity = model_identity(model, revision, declared, snapshot=snapshot)
    if declared:
        how = "declared by the model_identity setting"
    elif _SHA256_HEX.fullmatch(identity):
        how = "fingerprint of the model's files"
    else:
        how = "no local files found: the model's name and revision"
    logger.info(
        "model identity %s (%s, %.2f s)", short_identity(identity), how, time.monotonic() - t0
    )
    return identity
