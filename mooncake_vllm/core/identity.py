"""What identifies an engine's KV for a raw block copy: its layout in words and the compat hash
both sides (P2P handoff, pool keys) must agree on."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Part of every digest: a change of what a raw block copy means bumps it.
COMPAT_VERSION = 1


def compat_hash(**fields: Any) -> str:
    """A stable digest of everything both sides must agree on for a raw block copy."""
    payload = json.dumps({"v": COMPAT_VERSION, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def kv_is_replicated(vllm_config: VllmConfig) -> bool:
    """An MLA engine's KV (one latent per token) is the same on every TP rank."""
    return bool(vllm_config.model_config.use_mla)


def _mla_latent(vllm_config: VllmConfig) -> list[int] | None:
    if not kv_is_replicated(vllm_config):
        return None
    hf = vllm_config.model_config.hf_text_config
    return [hf.kv_lora_rank, hf.qk_rope_head_dim]


def engine_kv_layout(vllm_config: VllmConfig, model_identity: str | None = None) -> str:
    """The engine's KV layout and model (``model_identity``) in words, for the error a
    mismatched handoff gets."""
    from mooncake_vllm.core.model_identity import short_identity

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    layers = mc.get_total_num_hidden_layers()  # all pipeline stages
    if (latent := _mla_latent(vllm_config)) is not None:
        kv = f"MLA latent {latent[0]}+{latent[1]}"
    else:
        kv = (
            f"per-head K/V {mc.get_total_num_kv_heads()} heads x {mc.get_head_size()} "
            f"(TP {pc.tensor_parallel_size})"
        )
    words = f"{kv}, {layers} layers, {mc.dtype}, KV {cc.cache_dtype}, block {cc.block_size}"
    return words if model_identity is None else f"{words}, model {short_identity(model_identity)}"


def engine_kv_heads(vllm_config: VllmConfig) -> int:
    """The model's KV heads, all TP ranks together (an MLA latent counts as one head)."""
    if kv_is_replicated(vllm_config):
        return 1
    return vllm_config.model_config.get_total_num_kv_heads()


def engine_compat_hash(
    vllm_config: VllmConfig, model_identity: str | None = None, *, any_layout: bool = False
) -> str:
    """What producer and consumer must agree on for a raw block copy: the KV layout and, since
    KV from other weights of the same shape decodes into a wrong answer, the model
    (``model_identity.engine_model_identity``; None leaves it out). ``any_layout``: leave the TP
    size and block size out, for a consumer that re-lays KV out (``planning.plan_pull``)."""
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    use_mla = kv_is_replicated(vllm_config)
    # An MLA layer caches one latent per token, [kv_lora_rank | qk_rope_head_dim] values, instead
    # of K and V per head. Named here, not left to head_size and kv_heads to imply: a per-head K/V
    # block and a latent block, or latents of another width or split, must never validate
    # against each other. The latent is replicated across TP ranks, so its layout does not depend
    # on the TP size: MLA engines of any TP sizes validate against each other.
    mla_latent = _mla_latent(vllm_config)
    return compat_hash(
        architectures=getattr(mc.hf_config, "architectures", None),
        # The model's, not this pipeline stage's (a stage holds its own layers; a grant names
        # them, ``Granted.layers``), so that every stage and any PP size validate alike.
        layers=mc.get_total_num_hidden_layers(),
        kv_heads=engine_kv_heads(vllm_config) if any_layout else mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(),
        use_mla=use_mla,
        mla_latent=mla_latent,
        dtype=str(mc.dtype),
        kv_dtype=cc.cache_dtype,
        block_size=None if any_layout else cc.block_size,
        tp_size=None if use_mla or any_layout else pc.tensor_parallel_size,
        device=current_platform.device_type,
        model=model_identity,
    )
