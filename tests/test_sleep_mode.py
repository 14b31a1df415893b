"""Both connectors refuse vLLM's sleep mode at startup (``refuse_sleep_mode`` says why).

On CPU vLLM itself rejects ``--enable-sleep-mode`` before any connector is built ("Sleep mode is
not supported on current platform."), so the connectors' own refusal is checked here without a
server: built the way vLLM builds them, with an engine config that has sleep mode on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from mooncake_vllm.connector import MooncakeConnector
from mooncake_vllm.core.settings import ConfigError
from mooncake_vllm.core.sleep_mode import refuse_sleep_mode
from mooncake_vllm.pool.connector import MooncakeStoreConnector


def _engine_config(*, sleep_mode: bool, connector: str, role: str) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(enable_sleep_mode=sleep_mode),
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role=role),
    )


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
@pytest.mark.parametrize(
    "cls, kv_role",
    [(MooncakeConnector, "kv_producer"), (MooncakeConnector, "kv_consumer"),
     (MooncakeStoreConnector, "kv_both")],
)  # fmt: skip
def test_a_connector_built_with_sleep_mode_stops_the_engine_naming_the_flag(cls, kv_role, role):
    cfg = _engine_config(sleep_mode=True, connector=cls.__name__, role=kv_role)
    with pytest.raises(ConfigError) as e:
        cls(cfg, role, None)  # refused before the config is read or anything is registered
    assert "--enable-sleep-mode" in str(e.value)
    assert cls.__name__ in str(e.value)


def test_without_sleep_mode_nothing_is_refused():
    cfg = _engine_config(sleep_mode=False, connector="MooncakeConnector", role="kv_producer")
    assert refuse_sleep_mode(cfg, "MooncakeConnector") is None
    assert refuse_sleep_mode(SimpleNamespace(), "MooncakeConnector") is None  # no model config


@pytest.mark.parametrize("cls", [MooncakeConnector, MooncakeStoreConnector])
def test_vllm_033s_sleep_hooks_decline_and_refuse(cls):
    """vLLM 0.33 asks ``supports_sleep_mode`` before it builds a connector, and stops an engine
    started with ``--enable-sleep-mode`` when it answers False; the sleep and wake-up hooks are
    then never called, and would refuse with the reason if they were."""
    kv = KVTransferConfig(kv_connector=cls.__name__, kv_role="kv_both")
    assert cls.supports_sleep_mode(kv) is False
    half_built = object.__new__(cls)
    for hook in (half_built.unregister_kv_caches, half_built.restore_kv_caches):
        with pytest.raises(RuntimeError, match="--enable-sleep-mode"):
            hook()
