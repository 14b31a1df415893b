"""Settings: the json file and extra config merged and validated, the role's address and ports,
the transfer-engine environment. Each test builds what a user's config would and asserts the
error or value the user would see."""

from __future__ import annotations

import json

import pytest

from mooncake_vllm.core.settings import CONFIG_PATH_ENV, ConfigError
from mooncake_vllm.metadata import MetadataTarget
from mooncake_vllm.p2p.config import load_settings, resolve

# ---- config: load_settings ------------------------------------------------------------------


@pytest.fixture
def config_file(tmp_path):
    """Write a Mooncake json and return the env that points ``MOONCAKE_CONFIG_PATH`` at it."""

    def write(content: dict | str | bytes) -> dict[str, str]:
        path = tmp_path / "mooncake.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        return {CONFIG_PATH_ENV: str(path)}

    return write


def test_defaults_without_file_or_extra_config():
    s = load_settings(None, env={})
    assert s.prefill_url == "127.0.0.1:13003"
    assert s.decode_url == "127.0.0.1:13012"
    assert s.local_hostname is None
    assert s.metadata_server == "P2PHANDSHAKE"
    assert s.metadata_backend is None
    assert s.protocol == "tcp"
    assert s.device_name == ""
    assert s.kv_buffer_size == 1_000_000_000
    assert s.lease_ttl_s == 30.0
    assert s.load_timeout_s == 30.0
    assert s.max_batch_entries == 512


def test_json_file_is_read(config_file):
    env = config_file({"prefill_url": "10.0.0.1:20000", "protocol": "rdma", "device_name": "mlx5"})
    s = load_settings(None, env=env)
    assert (s.prefill_url, s.protocol, s.device_name) == ("10.0.0.1:20000", "rdma", "mlx5")
    assert s.decode_url == "127.0.0.1:13012"  # untouched keys keep their defaults


def test_extra_config_overrides_json(config_file):
    env = config_file({"lease_ttl_s": 5, "kv_buffer_size": 100, "decode_url": "10.0.0.2:14000"})
    s = load_settings({"lease_ttl_s": 7.5, "kv_buffer_size": 200}, env=env)
    assert s.lease_ttl_s == 7.5
    assert s.kv_buffer_size == 200
    assert s.decode_url == "10.0.0.2:14000"  # json keys not in extra_config survive


def test_empty_config_path_means_no_file():
    assert load_settings({}, env={CONFIG_PATH_ENV: ""}).protocol == "tcp"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # unknown key: names it and lists the accepted keys
        ({"kv_rank": 0}, ["'kv_rank'", "unknown key", "accepted keys", "kv_buffer_size"]),
        # wrong types
        ({"kv_buffer_size": "lots"}, ["kv_buffer_size='lots'", "valid integer"]),
        ({"kv_buffer_size": 1.5}, ["kv_buffer_size=1.5", "valid integer"]),
        ({"lease_ttl_s": "soon"}, ["lease_ttl_s='soon'", "valid number"]),
        ({"prefill_url": 13003}, ["prefill_url=13003", "valid string"]),
        # out-of-range numbers
        ({"kv_buffer_size": 0}, ["kv_buffer_size=0", "greater than 0"]),
        ({"load_timeout_s": -1}, ["load_timeout_s=-1", "greater than 0"]),
        ({"max_batch_entries": 5000}, ["max_batch_entries=5000", "less than or equal to 2000"]),
        # enumerations
        ({"protocol": "udp"}, ["protocol='udp'", "'tcp' or 'rdma'"]),
        ({"metadata_backend": "zk"}, ["metadata_backend='zk'", "'etcd'", "'http'"]),
        # host:port
        ({"prefill_url": "nohost"}, ["prefill_url='nohost'", "'host:port'", "127.0.0.1:13003"]),
        ({"decode_url": ":13012"}, ["decode_url=':13012'", "'host:port'"]),
        ({"decode_url": "h:port"}, ["decode_url='h:port'", "'host:port'"]),
        ({"decode_url": "h:0"}, ["decode_url='h:0'", "'host:port'"]),
        ({"decode_url": "h:65536"}, ["decode_url='h:65536'", "'host:port'"]),
        # metadata server
        (
            {"metadata_server": "etcd://10.0.0.1:2379", "metadata_backend": "redis"},
            ["metadata_backend='redis' contradicts", "metadata_server='etcd://10.0.0.1:2379'"],
        ),
        (
            {"metadata_server": "etcd://h1:2379,h2"},
            ["metadata_server='etcd://h1:2379,h2'", "'h2' is not 'host:port'"],
        ),
        ({"metadata_server": "redis://"}, ["metadata_server='redis://'", "not 'host:port'"]),
        ({"metadata_ttl_s": 1}, ["metadata_ttl_s=1", "greater than or equal to 3"]),
        (
            {"metadata_server": "zookeeper"},
            ["metadata_server='zookeeper'", "accepted forms", "'P2PHANDSHAKE'", "etcd://"],
        ),
        (
            {"metadata_server": "ftp://h:1"},
            ["metadata_server='ftp://h:1'", "accepted forms", "http://host:port/metadata"],
        ),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_bad_setting_names_key_value_and_accepted_forms(extra, expected):
    with pytest.raises(ConfigError) as exc:
        load_settings(extra, env={})
    message = str(exc.value)
    assert "kv_connector_extra_config" in message  # where the bad value came from
    for part in expected:
        assert part in message


def test_bad_setting_in_json_names_the_file(config_file):
    env = config_file({"protocol": "udp"})
    with pytest.raises(ConfigError) as exc:
        load_settings(None, env=env)
    assert env[CONFIG_PATH_ENV] in str(exc.value)
    assert "protocol='udp'" in str(exc.value)


def test_every_bad_key_is_reported_at_once():
    with pytest.raises(ConfigError) as exc:
        load_settings({"kv_rank": 0, "protocol": "udp"}, env={})
    assert "'kv_rank'" in str(exc.value)
    assert "protocol='udp'" in str(exc.value)


@pytest.mark.parametrize(
    "metadata_server",
    [
        "P2PHANDSHAKE",
        "etcd://10.0.0.1:2379",
        "etcd://h1:2379,h2:2379",
        "redis://10.0.0.1:6379",
        "redis://10.0.0.1:6379/2",
        "http://h:8080/metadata",
        "h:2379",
    ],
)
def test_accepted_metadata_servers(metadata_server):
    assert load_settings({"metadata_server": metadata_server}, env={}).metadata_server == (
        metadata_server
    )


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError) as exc:
        load_settings(None, env={CONFIG_PATH_ENV: path})
    message = str(exc.value)
    assert CONFIG_PATH_ENV in message
    assert path in message
    assert "cannot be read" in message
    assert "kv_connector_extra_config" in message  # the alternative


def test_unreadable_file(tmp_path):
    # A directory cannot be read as a file, whoever runs the test (root ignores file modes).
    with pytest.raises(ConfigError) as exc:
        load_settings(None, env={CONFIG_PATH_ENV: str(tmp_path)})
    assert str(tmp_path) in str(exc.value)
    assert "cannot be read" in str(exc.value)


@pytest.mark.parametrize(
    "content", ['{"protocol": "tcp",}', "", "prefill_url = 1", b"\xff\xfe{}"], ids=repr
)
def test_invalid_json(config_file, content):
    env = config_file(content)
    with pytest.raises(ConfigError) as exc:
        load_settings(None, env=env)
    assert env[CONFIG_PATH_ENV] in str(exc.value)
    assert "not valid JSON" in str(exc.value)


@pytest.mark.parametrize("content", ["[]", '"tcp"', "1", "null"])
def test_json_must_hold_an_object(config_file, content):
    env = config_file(content)
    with pytest.raises(ConfigError) as exc:
        load_settings(None, env=env)
    assert env[CONFIG_PATH_ENV] in str(exc.value)
    assert "JSON object" in str(exc.value)


# ---- config: resolve ------------------------------------------------------------------------


def _settings(**extra):
    return load_settings(extra, env={})


@pytest.mark.parametrize(
    ("role", "own_url"),
    [
        ("kv_producer", "10.0.0.1:20000"),
        ("kv_both", "10.0.0.1:20000"),
        ("kv_consumer", "10.0.0.2:30000"),
    ],
)
def test_each_role_listens_on_its_own_url(role, own_url):
    s = _settings(prefill_url="10.0.0.1:20000", decode_url="10.0.0.2:30000")
    cfg = resolve(s, role, "engine-a", tp_size=4)
    host, port = own_url.split(":")
    assert (cfg.host, cfg.base_port) == (host, int(port))
    assert cfg.is_producer == (role != "kv_consumer")
    assert cfg.is_consumer == (role != "kv_producer")


def test_ports_per_rank():
    cfg = resolve(_settings(prefill_url="10.0.0.1:20000"), "kv_producer", "e", tp_size=4)
    assert [cfg.engine_hostname(r) for r in range(4)] == [
        "10.0.0.1:20000",
        "10.0.0.1:20002",
        "10.0.0.1:20004",
        "10.0.0.1:20006",
    ]
    assert [cfg.side_channel_port(r) for r in range(4)] == [20001, 20003, 20005, 20007]


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
@pytest.mark.parametrize(
    ("prefill_port", "decode_port", "tp_size"),
    [(13000, 13001, 1), (13000, 13003, 2), (13010, 13004, 4), (13000, 13000, 1)],
)
def test_same_host_port_collision_is_detected(role, prefill_port, decode_port, tp_size):
    s = _settings(prefill_url=f"h:{prefill_port}", decode_url=f"h:{decode_port}")
    with pytest.raises(ConfigError) as exc:
        resolve(s, role, "e", tp_size=tp_size)
    message = str(exc.value)
    assert f"prefill_url='h:{prefill_port}'" in message
    assert f"decode_url='h:{decode_port}'" in message
    assert f"at least {2 * tp_size} apart" in message


@pytest.mark.parametrize(
    ("prefill_url", "decode_url", "tp_size"),
    [
        ("h:13000", "h:13002", 1),  # exactly 2 * tp apart
        ("h:13008", "h:13000", 4),
        ("a:13000", "b:13000", 8),  # other host: same ports are fine
    ],
)
def test_ports_far_enough_apart_are_accepted(prefill_url, decode_url, tp_size):
    s = _settings(prefill_url=prefill_url, decode_url=decode_url)
    for role in ("kv_producer", "kv_consumer"):
        resolve(s, role, "e", tp_size=tp_size)


def test_port_too_high_for_tp_size():
    s = _settings(prefill_url="h:65530", decode_url="g:13000")
    resolve(s, "kv_producer", "e", tp_size=3)  # uses 65530..65535
    with pytest.raises(ConfigError) as exc:
        resolve(s, "kv_producer", "e", tp_size=4)
    assert "prefill_url='h:65530'" in str(exc.value)
    assert "tp_size" in str(exc.value)


@pytest.mark.parametrize("role", [None, "", "producer", "kv_lookup", "KV_PRODUCER"])
def test_bad_role(role):
    with pytest.raises(ConfigError) as exc:
        resolve(_settings(), role, "e", tp_size=1)
    message = str(exc.value)
    assert f"kv_role={role!r}" in message
    for accepted in ("'kv_producer'", "'kv_consumer'", "'kv_both'"):
        assert accepted in message


def test_tcp_protocol_forces_tcp_in_the_engine_env():
    env = resolve(_settings(protocol="tcp"), "kv_producer", "e", 1).engine_env()
    assert env["MC_FORCE_TCP"] == "1"
    assert (
        "MC_FORCE_TCP"
        not in resolve(_settings(protocol="rdma"), "kv_producer", "e", 1).engine_env()
    )


def test_tcp_bind_address_follows_the_url_host():
    s = _settings(prefill_url="10.0.0.1:20000", decode_url="10.0.0.2:30000")
    assert resolve(s, "kv_producer", "e", 1).engine_env()["MC_TCP_BIND_ADDRESS"] == "10.0.0.1"
    assert resolve(s, "kv_consumer", "e", 1).engine_env()["MC_TCP_BIND_ADDRESS"] == "10.0.0.2"


@pytest.mark.parametrize(
    ("metadata_server", "refresh"),
    [("P2PHANDSHAKE", None), ("etcd://h:2379", "5"), ("redis://h:6379", "5")],
)
def test_peer_metadata_refresh_only_with_a_store(metadata_server, refresh, monkeypatch):
    # With a store a restarted peer keeps its name; with P2P it gets a new one, and the periodic
    # sync asks the peer itself (once seen beside a read hung for 30 s).
    monkeypatch.delenv("MC_TE_METADATA_REFRESH_INTERVAL_SECONDS", raising=False)
    cfg = resolve(_settings(metadata_server=metadata_server), "kv_consumer", "e", 1)
    assert cfg.engine_env().get("MC_TE_METADATA_REFRESH_INTERVAL_SECONDS") == refresh


def test_local_hostname_replaces_the_url_host():
    s = _settings(prefill_url="10.0.0.1:20000", local_hostname="node-7.example")
    cfg = resolve(s, "kv_producer", "e", tp_size=2)
    assert cfg.host == "node-7.example"
    assert cfg.engine_hostname(1) == "node-7.example:20002"
    assert cfg.engine_env()["MC_TCP_BIND_ADDRESS"] == "node-7.example"


@pytest.mark.parametrize(
    ("settings", "target"),
    [
        ({}, MetadataTarget("p2p")),
        ({"metadata_server": "etcd://h:2379"}, MetadataTarget("etcd", ("h:2379",))),
        (
            {"metadata_server": "etcd://h1:2379;h2:2379"},  # Mooncake's separator
            MetadataTarget("etcd", ("h1:2379", "h2:2379")),
        ),
        ({"metadata_server": "h:2379"}, MetadataTarget("etcd", ("h:2379",))),  # legacy: etcd
        (
            {"metadata_server": "h1:2379, h2:2379", "metadata_backend": "etcd"},
            MetadataTarget("etcd", ("h1:2379", "h2:2379")),
        ),
        (
            {"metadata_server": "h:6379", "metadata_backend": "redis"},
            MetadataTarget("redis", ("redis://h:6379",)),
        ),
        ({"metadata_server": "redis://h:6379"}, MetadataTarget("redis", ("redis://h:6379",))),
        (
            {"metadata_server": "h:8080", "metadata_backend": "http"},
            MetadataTarget("http", ("http://h:8080/metadata",)),
        ),
        (
            {"metadata_server": "http://h:8080/metadata", "metadata_backend": "http"},
            MetadataTarget("http", ("http://h:8080/metadata",)),
        ),
    ],
)
def test_metadata_target(settings, target):
    assert resolve(_settings(**settings), "kv_producer", "e", 1).metadata == target


@pytest.mark.parametrize(
    ("device", "async_scheduling", "ok"),
    [("cpu", False, True), ("cuda", False, False), ("cpu", True, False)],
)
def test_layerwise_handoff_is_refused_at_startup_off_vllms_synchronous_cpu_backend(
    device, async_scheduling, ok
):
    from types import SimpleNamespace

    from mooncake_vllm.p2p.connector import check_layerwise

    vllm_config = SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
    )
    if ok:
        check_layerwise(vllm_config)
        return
    with pytest.raises(ConfigError, match=r"layerwise_handoff=true .* to false"):
        check_layerwise(vllm_config)


@pytest.mark.parametrize(
    ("pp", "layerwise", "refused"),
    [
        (1, False, None),
        (2, False, None),
        (4, False, None),
        (1, True, None),
        (2, True, r"--pipeline-parallel-size 2: layerwise_handoff .* to false"),
    ],
)
def test_pipeline_parallel_starts_and_refuses_layerwise_handoff_naming_the_flag(
    pp, layerwise, refused
):
    from types import SimpleNamespace

    from mooncake_vllm.p2p.connector import check_pipeline_parallel

    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=pp))
    if refused is None:
        assert check_pipeline_parallel(vllm_config, layerwise) == pp
        return
    with pytest.raises(ConfigError, match=refused):
        check_pipeline_parallel(vllm_config, layerwise)


def test_a_pipeline_parallel_engine_takes_two_ports_per_worker():
    settings = load_settings({"prefill_url": "127.0.0.1:13000", "decode_url": "127.0.0.1:13008"})
    cfg = resolve(settings, "kv_producer", "p", 2, pp_size=2)
    assert cfg.ranks == 4 and cfg.rank(1, 1) == 3
    assert [cfg.side_channel_port(r) for r in range(cfg.ranks)] == [13001, 13003, 13005, 13007]
    assert cfg.engine_hostname(3) == "127.0.0.1:13006"
    with pytest.raises(ConfigError, match=r"each side uses 8 ports .* \(tp_size 2 × pp_size 2\)"):
        resolve(load_settings({"prefill_url": "127.0.0.1:13000", "decode_url": "127.0.0.1:13006"}),
                "kv_producer", "p", 2, pp_size=2)  # fmt: skip


def test_a_hybrid_model_is_refused_with_layerwise_handoff_and_a_mamba_group_at_all():
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from mooncake_vllm.p2p.connector import engine_kv_groups

    def group(spec_type, names, **kw):
        spec = object.__new__(spec_type)
        for k, v in kw.items():
            object.__setattr__(spec, k, v)
        return SimpleNamespace(layer_names=names, kv_cache_spec=spec, enable_kv_transfer=True)

    full = group(FullAttentionSpec, ["l.2"])
    sliding = group(SlidingWindowSpec, ["l.0", "l.1"], sliding_window=128)
    hybrid = SimpleNamespace(kv_cache_groups=[sliding, full])
    groups = engine_kv_groups(hybrid, layerwise=False)
    assert [g.describe() for g in groups] == ["sliding window 128", "full attention"]
    assert len(engine_kv_groups(SimpleNamespace(kv_cache_groups=[full]), layerwise=True)) == 1
    with pytest.raises(ConfigError, match=r"layerwise_handoff=true .* 2 \(sliding window 128"):
        engine_kv_groups(hybrid, layerwise=True)
    mamba = SimpleNamespace(kv_cache_groups=[full, group(MambaSpec, ["m.0"])])
    with pytest.raises(ConfigError, match=r"KV cache group 1 \(1 layers\) is MambaSpec"):
        engine_kv_groups(mamba, layerwise=False)
