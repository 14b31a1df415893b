"""The model identity in the compat hash: a fingerprint of the model's files that tells a
same-shaped fine-tune apart, a declared name that overrides it, and the hub-name fallbacks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from mooncake_vllm.core.model_identity import (
    RANGE_SAMPLE_BYTES,
    TENSOR_SAMPLE_BYTES,
    fingerprint_model,
    hub_snapshot,
    model_identity,
    short_identity,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 256}
# Eight 1 MiB tensors in one 8 MiB file: the start, middle and end of the file alone would miss
# most of them.
NAMES = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(8)]


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((256, 1024), dtype=np.float32) for name in NAMES}


def write_model(path: Path, tensors: dict[str, np.ndarray], config=CONFIG) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def tensor_data_range(path: Path, name: str) -> tuple[int, int]:
    """Where tensor ``name``'s bytes are in a safetensors file: ``(begin, end)``."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        begin, end = json.loads(f.read(header_len))[name]["data_offsets"]
    return 8 + header_len + begin, 8 + header_len + end


def test_the_same_files_anywhere_give_the_same_fingerprint(tmp_path):
    a = write_model(tmp_path / "a", weights())
    b = write_model(tmp_path / "elsewhere" / "b", weights())
    ident = model_identity(str(a))
    assert ident == model_identity(str(b)) == fingerprint_model(a)
    assert len(ident) == 64 and short_identity(ident) == ident[:12]


@pytest.mark.parametrize("name", [NAMES[0], NAMES[2], NAMES[-1]], ids=["first", "third", "last"])
def test_a_fine_tune_of_one_tensor_changes_the_fingerprint(tmp_path, name):
    """A merged LoRA or partly unfrozen model changes some tensors only: each is sampled."""
    base = weights()
    tuned = {**base, name: base[name] + np.float32(1e-3)}
    assert model_identity(str(write_model(tmp_path / "base", base))) != model_identity(
        str(write_model(tmp_path / "tuned", tuned))
    )


def test_one_changed_byte_in_a_sampled_range_changes_the_fingerprint(tmp_path):
    model = write_model(tmp_path / "m", weights())
    before = model_identity(str(model))
    begin, end = tensor_data_range(model / "model.safetensors", NAMES[5])
    flip_byte(model / "model.safetensors", (begin + end) // 2)  # in the tensor's middle sample
    assert model_identity(str(model)) != before


def test_a_byte_outside_every_sample_is_not_seen(tmp_path):
    """The documented limit: a change that spares every tensor's sample goes unnoticed."""
    model = write_model(tmp_path / "m", weights())
    before = model_identity(str(model))
    begin, end = tensor_data_range(model / "model.safetensors", NAMES[5])
    assert end - begin > 2 * TENSOR_SAMPLE_BYTES
    flip_byte(model / "model.safetensors", begin + 1)
    assert model_identity(str(model)) == before


def test_config_json_is_covered(tmp_path):
    a = write_model(tmp_path / "a", weights())
    b = write_model(tmp_path / "b", weights(), config={**CONFIG, "rope_theta": 500000.0})
    assert model_identity(str(a)) != model_identity(str(b))


def test_other_weight_formats_are_sampled_at_start_middle_and_end(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    blob = model / "pytorch_model.bin"
    blob.write_bytes(np.random.default_rng(1).bytes(8 * RANGE_SAMPLE_BYTES))
    before = model_identity(str(model))
    flip_byte(blob, 2 * RANGE_SAMPLE_BYTES)  # between the start and middle samples: not seen
    assert model_identity(str(model)) == before
    flip_byte(blob, 4 * RANGE_SAMPLE_BYTES)  # in the middle sample
    assert model_identity(str(model)) != before


def test_safetensors_present_other_formats_are_ignored(tmp_path):
    """vLLM loads the safetensors then: a stray .bin in one copy must not split the identity."""
    a = write_model(tmp_path / "a", weights())
    b = write_model(tmp_path / "b", weights())
    (b / "pytorch_model.bin").write_bytes(b"other bytes")
    assert model_identity(str(a)) == model_identity(str(b))


def test_a_single_weight_file_model_is_fingerprinted(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    ident = model_identity(str(gguf))
    assert len(ident) == 64
    flip_byte(gguf, 500)
    assert model_identity(str(gguf)) != ident


def test_a_declared_name_wins(tmp_path):
    a = write_model(tmp_path / "a", weights(seed=0))
    b = write_model(tmp_path / "b", weights(seed=1))
    assert model_identity(str(a), declared="team/llama-ft-7") == "team/llama-ft-7"
    assert model_identity(str(a), declared="x") == model_identity(str(b), declared="x")
    assert short_identity("team/llama-ft-7") == "team/llama-ft-7"


def test_a_hub_name_uses_its_local_snapshot_or_else_its_name_and_revision(tmp_path):
    snapshot = write_model(tmp_path / "snapshot", weights())
    found = model_identity("org/model", "v2", snapshot=lambda m, r: snapshot)
    assert found == fingerprint_model(snapshot)
    assert model_identity("org/model", "v2", snapshot=lambda m, r: None) == "org/model@v2"
    assert model_identity("org/model", snapshot=lambda m, r: None) == "org/model"
    missing = str(tmp_path / "not-there")
    assert model_identity(missing, snapshot=lambda m, r: None) == missing


def test_hub_snapshot_finds_a_model_in_hugging_faces_cache(tmp_path):
    """The cache layout huggingface_hub writes: refs/<revision> names the snapshot's commit."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    write_model(repo / "snapshots" / commit, weights())
    found = hub_snapshot("org/model", None, cache_dir=str(tmp_path))
    assert found == repo / "snapshots" / commit
    assert hub_snapshot("org/other", None, cache_dir=str(tmp_path)) is None
    assert hub_snapshot("/an/absolute/path", None, cache_dir=str(tmp_path)) is None
    shutil.rmtree(repo / "snapshots")
    assert hub_snapshot("org/model", None, cache_dir=str(tmp_path)) is None
