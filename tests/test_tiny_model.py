import hashlib
from pathlib import Path

from harness.tiny_model import TinyMLASpec, TinyModelSpec, build_tiny_model


def _digests(d: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }


def test_two_builds_are_byte_identical(tmp_path):
    spec = TinyModelSpec(layers=2, hidden=128, heads=2, kv_heads=2, head_dim=64, vocab=512)
    a = build_tiny_model(tmp_path / "a", spec)
    b = build_tiny_model(tmp_path / "b", spec)
    da, db = _digests(a), _digests(b)
    assert "model.safetensors" in da and "tokenizer.json" in da
    assert da == db


def test_two_mla_builds_are_byte_identical(tmp_path):
    spec = TinyMLASpec(vocab=512)  # a smaller tokenizer trains faster; the latent stays 512 + 64
    a = build_tiny_model(tmp_path / "a", spec)
    b = build_tiny_model(tmp_path / "b", spec)
    da, db = _digests(a), _digests(b)
    assert "model.safetensors" in da and "tokenizer.json" in da
    assert da == db


def test_mla_model_config_is_what_vllm_cpu_mla_serves():
    import json

    spec = TinyMLASpec()
    cfg = json.loads((build_tiny_model(spec=spec) / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v2"
    assert cfg["num_hidden_layers"] == spec.layers == 2
    # The CPU MLA decode kernel only takes a 576-wide latent.
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == spec.latent_width == 576
    assert cfg["q_lora_rank"] is None
    # Every layer dense: no layer index reaches first_k_dense_replace.
    assert cfg["first_k_dense_replace"] >= cfg["num_hidden_layers"]
    assert cfg["max_position_embeddings"] >= 2048
    assert spec.kv_bytes_per_token == 2 * 576 * 4
    assert spec.name.startswith("tiny-dsv2-mla-l2-h256-")
    assert spec.name != TinyMLASpec(seed=spec.seed + 1).name


def test_default_model_shape_and_cache(tiny_model):
    import json

    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    spec = TinyModelSpec()
    assert cfg["num_hidden_layers"] == spec.layers == 4
    assert cfg["hidden_size"] == 256
    assert cfg["num_key_value_heads"] == 4 and cfg["head_dim"] == 64
    assert cfg["max_position_embeddings"] >= 2048
    # cached: a second call returns the same directory without rebuilding
    mtime = (Path(tiny_model) / "model.safetensors").stat().st_mtime_ns
    assert str(build_tiny_model()) == tiny_model
    assert (Path(tiny_model) / "model.safetensors").stat().st_mtime_ns == mtime


def test_tokenizer_round_trips_text(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "the quick brown fox moves the cache block to the decode server 42."
    ids = tok(text)["input_ids"]
    assert 5 < len(ids) < len(text)  # merges happened: fewer tokens than bytes
    assert tok.decode(ids, skip_special_tokens=True) == text
