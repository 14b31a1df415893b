"""vLLM general plugin: make the name ``MooncakeConnector`` select this package's connector.

vLLM runs ``vllm.general_plugins`` entry points in every vLLM process before it parses the CLI,
so ``--kv-transfer-config '{"kv_connector":"MooncakeConnector",...}'`` resolves to ours. vLLM's
built-in connector stays available as ``VllmMooncakeConnector``; set
``MOONCAKE_VLLM_KEEP_BUILTIN=1`` to leave the name ``MooncakeConnector`` to vLLM's.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

NAME = "MooncakeConnector"
BUILTIN_ALIAS = "VllmMooncakeConnector"


def use_vllm_logging() -> None:
    """Send this package's log records through vLLM's handlers (its format, its level).

    vLLM configures only the ``vllm`` logger; without this our INFO lines would be dropped and
    warnings printed bare by Python's last-resort handler."""
    ours, theirs = logging.getLogger("mooncake_vllm"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    use_vllm_logging()
    # No public override API in vLLM 0.32: the factory's private name → loader dict.
    registry = getattr(KVConnectorFactory, "_registry", None)
    if not isinstance(registry, dict):
        logger.warning(
            "mooncake_vllm: this vLLM's KVConnectorFactory has no _registry dict, so the name %r "
            "keeps meaning vLLM's own connector. Select ours explicitly with "
            '"kv_connector_module_path": "mooncake_vllm.connector" in --kv-transfer-config.',
            NAME,
        )
        return
    builtin = registry.get(NAME)
    if builtin is not None and BUILTIN_ALIAS not in registry:
        registry[BUILTIN_ALIAS] = builtin
    if os.environ.get("MOONCAKE_VLLM_KEEP_BUILTIN", "") not in ("", "0"):
        return
    registry.pop(NAME, None)
    KVConnectorFactory.register_connector(NAME, "mooncake_vllm.connector", "MooncakeConnector")
