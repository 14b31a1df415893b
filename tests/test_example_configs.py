"""Every example in configs/ is a valid config for both sides of a pair."""

from pathlib import Path

import pytest

from mooncake_vllm.core.settings import CONFIG_PATH_ENV
from mooncake_vllm.core.settings import load_settings as core_load_settings
from mooncake_vllm.p2p.config import load_settings, resolve

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.json"))


def test_there_are_examples():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_example_config_resolves(path, role):
    settings = load_settings(None, {CONFIG_PATH_ENV: str(path)})
    cfg = resolve(settings, role, engine_id="e", tp_size=1)
    own = settings.prefill_url if role == "kv_producer" else settings.decode_url
    assert cfg.engine_hostname(0) == own
    assert cfg.metadata.kind in ("p2p", "etcd", "redis", "http")


def test_rdma_example_selects_rdma_on_its_nic():
    """The RDMA example is validated here, not run (no RDMA NIC on the test machines)."""
    settings = load_settings(
        None, {CONFIG_PATH_ENV: str(CONFIGS[0].parent / "mooncake-rdma-etcd.json")}
    )
    cfg = resolve(settings, "kv_producer", engine_id="e", tp_size=1)
    assert (settings.protocol, settings.device_name) == ("rdma", "mlx5_0")
    assert "MC_FORCE_TCP" not in cfg.engine_env()
    assert cfg.engine_env()["MC_TCP_BIND_ADDRESS"] == "10.0.0.2"
    assert cfg.metadata.kind == "etcd"


POOL_CONFIGS = sorted((CONFIGS[0].parent / "pool").glob("*.json"))


@pytest.mark.parametrize("path", POOL_CONFIGS, ids=lambda p: p.name)
def test_pool_example_config_validates(path):
    from mooncake_vllm.pool.config import PoolSettings

    s = core_load_settings(None, {CONFIG_PATH_ENV: str(path)}, model=PoolSettings)
    assert s.master_server_address and s.metadata_server.startswith("http://")
    assert s.global_segment_size >= 16 << 20
