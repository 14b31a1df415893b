"""The pool's config: the keys store users write, validated with errors naming the key."""

from __future__ import annotations

import json
import socket

import pytest

from mooncake_vllm.core.settings import CONFIG_PATH_ENV, ConfigError, load_settings
from mooncake_vllm.pool.config import PoolSettings, check_reachable, parse_size

BASE = {
    "master_server_address": "127.0.0.1:50051",
    "metadata_server": "http://127.0.0.1:8080/metadata",
}


def settings(env=None, **kw) -> PoolSettings:
    return load_settings({**BASE, **kw}, env=env or {}, model=PoolSettings)


def test_the_store_users_json_is_read_as_written(tmp_path):
    cfg = {
        "local_hostname": "10.0.0.2",
        "metadata_server": "http://10.0.0.1:8080/metadata",
        "global_segment_size": 3355443200,
        "local_buffer_size": "1GB",
        "protocol": "rdma",
        "device_name": "mlx5_0",
        "master_server_address": "10.0.0.1:50051",
        "transfer_timeout": 5,
    }
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(cfg))
    s = load_settings({"load_timeout_s": 3}, env={CONFIG_PATH_ENV: str(path)}, model=PoolSettings)
    assert s.global_segment_size == 3355443200 and s.local_buffer_size == 1 << 30
    assert s.protocol == "rdma" and s.device_name == "mlx5_0" and s.load_timeout_s == 3
    assert s.engine_env() == {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_BIND_ADDRESS": "10.0.0.2"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1024, 1024), ("512MB", 512 << 20), ("3.5 GiB", int(3.5 * (1 << 30))), ("16m", 16 << 20),
     (2.0**30, 1 << 30), ("100", 100)],
)  # fmt: skip
def test_sizes(value, expected):
    assert parse_size("k", value) == expected


def test_the_engines_progress_deadline_is_kept_unless_stall_timeout_s_is_set():
    # A 2 s MC_TCP_PROGRESS_TIMEOUT_SEC left holders not serving for 13-60 s on 0.3.13.post1;
    # the store keeps the engine's own 30 s unless the user asks.
    env = settings().engine_env()
    assert (env["MC_TRANSFER_TIMEOUT"], env["MC_FORCE_TCP"]) == ("10", "1")
    assert "MC_TCP_PROGRESS_TIMEOUT_SEC" not in env
    assert settings().load_timeout_s == 30.0
    assert settings(stall_timeout_s=5).engine_env()["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "5"
    assert "MC_TCP_PROGRESS_TIMEOUT_SEC" not in settings(protocol="rdma").engine_env()


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"master_server_address": "localhost"}, "master_server_address"),
        ({"metadata_server": "10.0.0.1:8080"}, "metadata_server"),
        ({"global_segment_size": 1 << 20}, "global_segment_size"),
        ({"global_segment_size": "lots"}, "global_segment_size"),
        ({"local_buffer_size": True}, "local_buffer_size"),
        ({"protocol": "udp"}, "protocol"),
        ({"transfer_timeout": 0}, "transfer_timeout"),
        ({"stall_timeout_s": 0}, "stall_timeout_s"),
        ({"stall_timeout_s": 61}, "stall_timeout_s"),
        ({"stall_timeout_s": 1.5}, "stall_timeout_s"),  # whole seconds: the engine's unit
        ({"prefill_url": "127.0.0.1:1"}, "prefill_url"),  # a P2P key: unknown here
    ],
)
def test_bad_values_name_the_key(overrides, named):
    with pytest.raises(ConfigError, match=named) as e:
        settings(**overrides)
    assert "MooncakeStoreConnector" in str(e.value)


def test_master_and_metadata_are_required():
    with pytest.raises(ConfigError, match="master_server_address"):
        load_settings({"metadata_server": "P2PHANDSHAKE"}, env={}, model=PoolSettings)


def test_an_absent_master_is_named_at_startup():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ConfigError, match=rf"master_server_address='127.0.0.1:{port}'"):
            check_reachable(settings(master_server_address=f"127.0.0.1:{port}"), timeout_s=1)


def test_a_listening_master_passes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(settings(master_server_address=f"127.0.0.1:{s.getsockname()[1]}"))


def test_the_store_binds_and_advertises_local_hostname_not_the_first_interface():
    assert settings(local_hostname="127.0.0.3").engine_env()["MC_TCP_BIND_ADDRESS"] == "127.0.0.3"
    assert (
        settings(local_hostname="10.0.0.2:12345").engine_env()["MC_TCP_BIND_ADDRESS"] == "10.0.0.2"
    )


@pytest.mark.parametrize("pp", [1, 2])
def test_pipeline_parallel_is_refused_for_the_pool_naming_the_flag(pp):
    from types import SimpleNamespace

    from mooncake_vllm.pool.connector import refuse_pipeline_parallel

    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=pp))
    if pp == 1:
        refuse_pipeline_parallel(vllm_config)
        return
    expected = r"--pipeline-parallel-size 2: .* --pipeline-parallel-size 1"
    with pytest.raises(ConfigError, match=expected):
        refuse_pipeline_parallel(vllm_config)
