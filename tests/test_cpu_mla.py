"""The startup warning for MLA on CPU with vLLM's faulty rotary_embedding op (``cpu_mla``)."""

import pytest

from mooncake_vllm.core.cpu_mla import FIX_FLAG, cpu_mla_rope_warning, rope_op_enabled


@pytest.mark.parametrize(
    ("custom_ops", "enabled"),
    [
        (["all"], True),
        (["none"], False),
        (["all", "-rotary_embedding"], False),
        (["none", "+rotary_embedding"], True),
        (["none", "+gelu"], False),
        (["all", "+gelu", "-rotary_embedding"], False),
    ],
)
def test_rope_op_enabled_follows_vllms_rule(custom_ops, enabled):
    assert rope_op_enabled(custom_ops) is enabled


@pytest.mark.parametrize(
    ("on_cpu", "use_mla", "custom_ops", "warns"),
    [
        (True, True, ["all"], True),
        (True, True, ["all", "-rotary_embedding"], False),
        (True, False, ["all"], False),  # a Llama passes a flat query: not affected
        (False, True, ["all"], False),  # GPU kernels are another op
    ],
)
def test_warning_only_for_mla_on_cpu_with_the_op(on_cpu, use_mla, custom_ops, warns):
    warning = cpu_mla_rope_warning(on_cpu, use_mla, custom_ops)
    assert (warning is not None) is warns
    if warns:
        assert FIX_FLAG in warning
