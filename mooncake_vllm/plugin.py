"""vLLM general plugin: make the names ``MooncakeConnector`` (P2P) and ``MooncakeStoreConnector``
(pool) select this package's connectors.

vLLM runs ``vllm.general_plugins`` entry points in every vLLM process before it parses the CLI,
so ``--kv-transfer-config '{"kv_connector":"MooncakeConnector",...}'`` resolves to ours. vLLM's
built-in connectors stay available as ``VllmMooncakeConnector`` and
``VllmMooncakeStoreConnector``; set ``MOONCAKE_VLLM_KEEP_BUILTIN=1`` to leave both names to vLLM's.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

NAME = "MooncakeConnector"
BUILTIN_ALIAS = "VllmMooncakeConnector"
STORE_NAME = "MooncakeStoreConnector"
STORE_BUILTIN_ALIAS = "VllmMooncakeStoreConnector"
# name → (builtin alias, our module, our class)
_OURS = {
    NAME: (BUILTIN_ALIAS, "mooncake_vllm.p2p.connector", "MooncakeConnector"),
    STORE_NAME: (STORE_BUILTIN_ALIAS, "mooncake_vllm.pool.connector", "MooncakeStoreConnector"),
}


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
    from mooncake_vllm.vllm_glue import register_names

    use_vllm_logging()
    keep_builtin = os.environ.get("MOONCAKE_VLLM_KEEP_BUILTIN", "") not in ("", "0")
    if not register_names(_OURS, keep_builtin):
        logger.warning(
            "mooncake_vllm: this vLLM's KVConnectorFactory has no _registry dict, so the name %r "
            "keeps meaning vLLM's own connector. Select ours explicitly with "
            '"kv_connector_module_path": "mooncake_vllm.connector" in --kv-transfer-config.',
            NAME,
        )
