"""The import path vLLM's ``kv_connector_module_path`` names for our P2P connector
(``"kv_connector_module_path": "mooncake_vllm.connector"``); the code is in ``p2p``."""

from mooncake_vllm.p2p.connector import MooncakeConnector

__all__ = ["MooncakeConnector"]
