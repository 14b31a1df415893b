"""The vLLM plugin that gives our connector the name ``MooncakeConnector`` (in-process)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from mooncake_vllm import plugin


@pytest.fixture
def registry(monkeypatch):
    # The plugin would route our loggers to vLLM's handlers, out of pytest's reach.
    monkeypatch.setattr(plugin, "use_vllm_logging", lambda: None)
    reg = KVConnectorFactory._registry
    saved = dict(reg)
    yield reg
    reg.clear()
    reg.update(saved)


def test_the_name_selects_ours_and_vllms_stays_reachable(registry, monkeypatch):
    monkeypatch.delenv("MOONCAKE_VLLM_KEEP_BUILTIN", raising=False)
    builtin = registry[plugin.NAME]
    plugin.register()
    assert registry[plugin.BUILTIN_ALIAS] is builtin
    assert registry[plugin.NAME]().__module__ == "mooncake_vllm.p2p.connector"


def test_keep_builtin_leaves_the_name_to_vllm(registry, monkeypatch):
    monkeypatch.setenv("MOONCAKE_VLLM_KEEP_BUILTIN", "1")
    builtin = registry[plugin.NAME]
    plugin.register()
    assert registry[plugin.NAME] is builtin


def test_a_vllm_without_the_private_registry_gets_a_clear_warning_not_a_crash(
    registry, monkeypatch, caplog
):
    monkeypatch.delattr(KVConnectorFactory, "_registry")
    plugin.register()
    assert "kv_connector_module_path" in caplog.text


def test_the_store_name_selects_our_pool_connector_and_vllms_stays_reachable(registry, monkeypatch):
    monkeypatch.delenv("MOONCAKE_VLLM_KEEP_BUILTIN", raising=False)
    builtin = registry[plugin.STORE_NAME]
    plugin.register()
    assert registry[plugin.STORE_BUILTIN_ALIAS] is builtin
    assert registry[plugin.STORE_NAME]().__module__ == "mooncake_vllm.pool.connector"
