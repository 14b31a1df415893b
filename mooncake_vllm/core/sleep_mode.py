"""Why both connectors refuse vLLM's sleep mode (``--enable-sleep-mode``), at startup.

Sleep mode frees device memory while the engine sleeps: level 1 discards the KV cache, level 2
also the weights, and ``wake_up`` maps fresh memory in. Our connectors register the KV cache with
the transfer engine once, in ``register_kv_caches``: a sleeping prefill would leave a consumer
pulling from freed memory, and after wake-up every registration names pages that are gone.
vLLM 0.32's connector API has no hook that tells a connector about sleep or wake-up (nor one to
decline sleep mode), so the refusal is a startup error, raised before anything is registered.
vLLM 0.33 adds them: ``supports_sleep_mode`` (ours answer False, so vLLM refuses the flag before
it builds a connector) and ``unregister_kv_caches`` / ``restore_kv_caches`` around a sleep (ours
raise: a registration cannot be withdrawn while a consumer may be reading it, and following a
remap would need every lease on the old pages ended first, which is not built).

``pause_generation`` (``POST /pause``, ``VLLM_SERVER_DEV_MODE=1``) frees no memory and needs
nothing from us: it aborts or drains requests through the usual ``request_finished`` and waits
until the engine is idle, which includes finished requests whose blocks a lease still holds.
"""

from __future__ import annotations

from typing import Any

from mooncake_vllm.core.settings import ConfigError


def refuse_sleep_mode(vllm_config: Any, connector: str) -> None:
    """ConfigError if the engine was started with sleep mode; nothing otherwise."""
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enable_sleep_mode", False):
        raise ConfigError(sleep_mode_refusal(connector))


def sleep_mode_refusal(connector: str) -> str:
    return (
        f"enable_sleep_mode=True (--enable-sleep-mode): {connector} registers the KV cache "
        "with the Mooncake Transfer Engine, and sleep mode frees that memory while peers may "
        "still read it. Start this server without --enable-sleep-mode, or without the "
        "connector (to use sleep mode on a server that does not take part in P/D)."
    )
