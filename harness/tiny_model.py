"""Small random-weight models with a locally trained byte-level BPE tokenizer.

Two kinds: a Llama (``TinyModelSpec``, K and V per head) and a DeepSeek-V2-style model with
multi-head latent attention (``TinyMLASpec``, one compressed latent per token). No network: the
tokenizer is trained on a text generated from a fixed seed, the weights are drawn from a seeded
generator. Two builds with the same parameters are byte-identical, and the result is cached under
``~/.cache/mooncake-vllm/models/<name>`` so it is built once per machine.

    python -m harness.tiny_model [OUT_DIR] [--layers 4 --hidden 256 ...]
    python -m harness.tiny_model --mla [OUT_DIR] [--layers 2 --kv-lora-rank 512 ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

CACHE_ROOT = Path(os.environ.get("MOONCAKE_VLLM_CACHE", Path.home() / ".cache" / "mooncake-vllm"))
_COMPLETE_MARKER = ".complete"

# A chat template so /v1/chat/completions works; plain text, no special formatting tokens.
_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_WORDS = (
    "the a of to and in is was for on that with as by at from it be this which or are an not but "
    "cache block token layer prefill decode transfer engine memory request model server proxy "
    "prompt stream batch queue worker scheduler lease segment region copy pull push latency "
    "north south river mountain city light stone water garden winter summer evening morning "
    "quick brown fox jumps over lazy dog seven eleven forty hundred thousand number value "
    "alpha beta gamma delta omega signal vector matrix tensor kernel thread socket packet"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 2048
    # Room for the long-prompt tests (16k tokens; 32k where a run asks for it).
    max_len: int = 32768
    # Larger than Llama's 0.02 so greedy logits have clear winners: token-exact comparisons
    # between code paths must not hinge on float ties.
    init_std: float = 0.1
    seed: int = 1234

    @property
    def name(self) -> str:
        return f"tiny-llama-l{self.layers}-h{self.hidden}-{_digest(self)}"

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 4  # K and V, float32

    def _hf_model(self, vocab_size: int, bos_token_id: int, eos_token_id: int):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            **_common_config(self, vocab_size, bos_token_id, eos_token_id),
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
        )
        return LlamaForCausalLM(config)


@dataclass(frozen=True)
class TinyMLASpec:
    """A DeepSeek-V2-style model vLLM serves with MLA: its KV cache holds, per layer and token, one
    latent of ``kv_lora_rank + qk_rope_head_dim`` values shared by all heads.

    The defaults are what vLLM's CPU MLA kernels accept (a 512 + 64 = 576-wide latent; the decode
    kernel compiles for no other). Every layer has a dense MLP: the CPU MoE path wants grouped
    top-k router settings a tiny model has no use for.
    """

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    intermediate: int = 512
    vocab: int = 2048
    max_len: int = 4096
    init_std: float = 0.1  # as the Llama's: clear greedy winners
    seed: int = 1234

    @property
    def name(self) -> str:
        return f"tiny-dsv2-mla-l{self.layers}-h{self.hidden}-{_digest(self)}"

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.latent_width * 4  # one latent, no separate V; float32

    def _hf_model(self, vocab_size: int, bos_token_id: int, eos_token_id: int):
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(
            **_common_config(self, vocab_size, bos_token_id, eos_token_id),
            num_key_value_heads=self.heads,
            q_lora_rank=None,  # a plain q_proj: one projection fewer to get right
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
            # No layer reaches first_k_dense_replace, so every MLP is dense (vLLM reads the same
            # key). The expert fields are unused, but transformers' config requires an int
            # expert count; the router fields are set to valid values all the same.
            first_k_dense_replace=self.layers,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=self.intermediate,
        )
        return DeepseekV2ForCausalLM(config)


@dataclass(frozen=True)
class TinyGemma3Spec:
    """A Gemma 3 text model: sliding-window layers between full-attention ones (every
    ``full_every``-th layer is full), which vLLM's hybrid memory allocator keeps in KV cache
    groups of their own, a sliding group holding only the last ``sliding_window`` tokens."""

    layers: int = 6
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 2048
    sliding_window: int = 128
    full_every: int = 3
    max_len: int = 8192
    init_std: float = 0.1  # as the Llama's: clear greedy winners
    seed: int = 1234

    @property
    def name(self) -> str:
        return f"tiny-gemma3-l{self.layers}-w{self.sliding_window}-{_digest(self)}"

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % self.full_every == 0 else "sliding_attention"
            for i in range(self.layers)
        ]

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 4  # K and V, float32

    def _hf_model(self, vocab_size: int, bos_token_id: int, eos_token_id: int):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            **_common_config(self, vocab_size, bos_token_id, eos_token_id),
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            query_pre_attn_scalar=self.head_dim,
            sliding_window=self.sliding_window,
            layer_types=self.layer_types,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            pad_token_id=0,
        )
        return Gemma3ForCausalLM(config)


TinySpec = TinyModelSpec | TinyMLASpec | TinyGemma3Spec

# vLLM flags for serving a TinyMLASpec model on CPU (beside the harness's --dtype float32): the
# reference MLA kernels, and vLLM's PyTorch rotary embedding instead of its CPU op, which rotates
# MLA queries wrongly (mooncake_vllm/cpu_mla.py).
MLA_CPU_ARGS = (
    "--attention-backend",
    "CPU_MLA",
    "--compilation-config",
    '{"custom_ops":["-rotary_embedding"]}',
)


def _common_config(spec: TinySpec, vocab_size: int, bos_token_id: int, eos_token_id: int) -> dict:
    """The config fields both model families take alike."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "max_position_embeddings": spec.max_len,
        "initializer_range": spec.init_std,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _digest(spec: TinySpec) -> str:
    return hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:10]


def _corpus(seed: int, n_words: int = 60_000) -> list[str]:
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(n_words):
        word = rng.choice(_WORDS)
        if rng.random() < 0.05:
            word = word.capitalize()
        if rng.random() < 0.03:
            word = str(rng.randrange(10_000))
        line.append(word)
        if len(line) >= rng.randrange(6, 20):
            lines.append(" ".join(line) + rng.choice([".", ",", "!", "?", ":"]))
            line = []
    return lines


def _write(spec: TinySpec, out: Path) -> None:
    # Imported here: the CLI's --help and the cache check need none of these heavy modules.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic BPE merges
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=spec.max_len,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(spec.seed)
    model = spec._hf_model(tok.get_vocab_size(), fast.bos_token_id, fast.eos_token_id)
    model = model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tiny_model_spec.json").write_text(json.dumps(asdict(spec), indent=2, sort_keys=True))


def _publish(out: Path, write) -> Path:
    """``write(dir)`` into a directory beside ``out``, then renamed to it: a crash or a
    concurrent build never leaves half a model (the complete marker says it is whole)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        (tmp / _COMPLETE_MARKER).write_text("")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except FileExistsError:
        pass  # another process won the race with an identical build
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tiny_model(out_dir: Path | str | None = None, spec: TinySpec | None = None) -> Path:
    """Return a directory holding the model (the Llama unless ``spec`` says otherwise), building
    it first if it is not there yet."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir) if out_dir else CACHE_ROOT / "models" / spec.name
    if (out / _COMPLETE_MARKER).exists():
        return out
    return _publish(out, lambda tmp: _write(spec, tmp))


def build_tiny_lora(
    model_dir: Path | str, name: str, seed: int, rank: int = 8, scale: float = 0.5
) -> Path:
    """A random-weight LoRA adapter (PEFT's on-disk format: ``adapter_config.json`` and
    ``adapter_model.safetensors``) on the attention projections of the tiny Llama at
    ``model_dir``, cached beside it as ``<model>-lora-<name>-<seed>``. Its B matrices are drawn,
    not zero as PEFT initialises them, so the adapter changes the answers (and the KV)."""
    model_dir = Path(model_dir)
    out = model_dir.parent / f"{model_dir.name}-lora-{name}-{seed}"
    if (out / _COMPLETE_MARKER).exists():
        return out
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv_out = config["num_key_value_heads"] * head_dim
    outs = {"q_proj": hidden, "k_proj": kv_out, "v_proj": kv_out, "o_proj": hidden}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, out_dim in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, hidden, generator=gen) * scale / hidden**0.5
            b = torch.randn(out_dim, rank, generator=gen) * scale / rank**0.5
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        adapter = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(model_dir),
            "r": rank,
            "lora_alpha": rank,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": sorted(outs),
            "fan_in_fan_out": False,
        }
        (tmp / "adapter_config.json").write_text(json.dumps(adapter, indent=2, sort_keys=True))

    return _publish(out, write)


def build_tiny_eagle(model_dir: Path | str, seed: int = 4321) -> Path:
    """A random-weight EAGLE-1 draft head for the tiny Llama at ``model_dir``, cached beside it
    as ``<model>-eagle-<seed>``, in the checkpoint layout vLLM's ``EagleLlamaForCausalLM``
    loads (``llama_eagle.py``): a one-layer Llama config, ``fc`` over the token's embedding and
    the target's hidden state, layer 0 without its input norm, no final norm and no ``lm_head``
    (both the target's). Served with ``--speculative-config '{"method": "eagle", "model":
    DIR, "num_speculative_tokens": N}'``; its one attention layer has a KV cache of its own."""
    model_dir = Path(model_dir)
    out = model_dir.parent / f"{model_dir.name}-eagle-{seed}"
    if (out / _COMPLETE_MARKER).exists():
        return out
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def drawn(*shape: int):
        return (torch.randn(*shape, generator=gen) * 0.1).contiguous()

    layer = "layers.0"
    tensors = {
        "fc.weight": drawn(hidden, 2 * hidden),
        "embed_tokens.weight": drawn(config["vocab_size"], hidden),
        f"{layer}.self_attn.q_proj.weight": drawn(heads * head_dim, hidden),
        f"{layer}.self_attn.k_proj.weight": drawn(kv_heads * head_dim, hidden),
        f"{layer}.self_attn.v_proj.weight": drawn(kv_heads * head_dim, hidden),
        f"{layer}.self_attn.o_proj.weight": drawn(hidden, heads * head_dim),
        f"{layer}.mlp.gate_proj.weight": drawn(inter, hidden),
        f"{layer}.mlp.up_proj.weight": drawn(inter, hidden),
        f"{layer}.mlp.down_proj.weight": drawn(hidden, inter),
        f"{layer}.post_attention_layernorm.weight": torch.ones(hidden),
    }
    draft = {**config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"],
             "tie_word_embeddings": False}  # fmt: skip

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(draft, indent=2, sort_keys=True))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (model_dir / name).exists():
                shutil.copy(model_dir / name, tmp / name)

    return _publish(out, write)


# Renders OpenAI-style content lists: an image item becomes the processor's ``<image>``.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<image>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_tiny_vlm(seed: int = 1234) -> Path:
    """A random-weight Idefics3 (SmolVLM's architecture: a SigLIP-style vision tower, a
    pixel-shuffle connector, a two-layer Llama), cached as ``tiny-idefics3-<seed>``, with its
    PIL image processor (no torchvision): a 64x64 image is one global image of 16 patches,
    4 image tokens after the connector. The text tokenizer is the tiny Llama's plus the
    processor's special tokens."""
    out = CACHE_ROOT / "models" / f"tiny-idefics3-{seed}"
    if (out / _COMPLETE_MARKER).exists():
        return out
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tok = AutoTokenizer.from_pretrained(build_tiny_model())
    special = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    special += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok.add_tokens(special, special_tokens=True)
    text = {"model_type": "llama", "vocab_size": 2112, "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
            "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.1,
            "tie_word_embeddings": False}  # fmt: skip
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 64, "patch_size": 16}  # fmt: skip
    config = Idefics3Config(
        vision_config=vision, text_config=text, scale_factor=2, pad_token_id=0,
        image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 64}, max_image_size={"longest_edge": 64}
    )
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=VLM_CHAT_TEMPLATE
    )
    tok.chat_template = VLM_CHAT_TEMPLATE

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)

    return _publish(out, write)


def main(argv: list[str] | None = None) -> None:
    # --mla picks the spec first: the two specs' options share names but not defaults.
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--mla", action="store_true")
    known, _ = pick.parse_known_args(argv)
    spec_cls = TinyMLASpec if known.mla else TinyModelSpec
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out_dir", nargs="?", help="where to write (default: the per-user cache)")
    p.add_argument("--mla", action="store_true", help="the DeepSeek-V2-style MLA model")
    for field, value in asdict(spec_cls()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = vars(p.parse_args(argv))
    out_dir = args.pop("out_dir")
    args.pop("mla")
    print(build_tiny_model(out_dir, spec_cls(**args)))


if __name__ == "__main__":
    main()
