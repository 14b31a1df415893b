"""The connector's pure parts: settings, region planning, wire formats and producer leases.

No servers and no transfer engine: each test builds the object a user's config or a peer's message
would produce and asserts what the user (or the peer) would see.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from mooncake_vllm.config import CONFIG_PATH_ENV, ConfigError, load_settings, resolve
from mooncake_vllm.leases import LeaseState, LeaseTable
from mooncake_vllm.metadata import MetadataTarget
from mooncake_vllm.planning import PlanError, Region, plan_regions, tensor_segments
from mooncake_vllm.protocol import (
    PROTOCOL_VERSION,
    Acquire,
    Granted,
    Handoff,
    HandoffError,
    MemSegment,
    Refused,
    Release,
    Released,
    compat_hash,
    decode_frame,
    encode_frame,
    parse_handoff,
    validate_handoff,
)

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


# ---- planning -------------------------------------------------------------------------------

BLOCK = 64  # bytes per block in the synthetic segments below


def _seg(base: int, stride: int = BLOCK, block_len: int = BLOCK) -> MemSegment:
    return MemSegment(base, stride, block_len)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "expected"),
    [
        # contiguous on both sides: one region
        ([0, 1, 2, 3], [4, 5, 6, 7], [Region(0, 4 * BLOCK, 4 * BLOCK)]),
        # contiguous remotely only: one region per block
        ([0, 1], [4, 6], [Region(0, 4 * BLOCK, BLOCK), Region(BLOCK, 6 * BLOCK, BLOCK)]),
        # contiguous locally only
        ([0, 2], [4, 5], [Region(0, 4 * BLOCK, BLOCK), Region(2 * BLOCK, 5 * BLOCK, BLOCK)]),
        # two runs
        (
            [0, 1, 5, 6, 7],
            [0, 1, 2, 3, 4],
            [Region(0, 0, 2 * BLOCK), Region(5 * BLOCK, 2 * BLOCK, 3 * BLOCK)],
        ),
        # descending ids never merge
        ([3, 2], [1, 0], [Region(3 * BLOCK, BLOCK, BLOCK), Region(2 * BLOCK, 0, BLOCK)]),
        # nothing to copy
        ([], [], []),
    ],
)
def test_region_merging_in_one_segment(src_ids, dst_ids, expected):
    assert plan_regions([_seg(0)], [_seg(0)], src_ids, dst_ids) == expected


def test_strided_blocks_do_not_merge():
    # Blocks with padding between them (stride > block_len) are never contiguous.
    src, dst = [_seg(0, stride=2 * BLOCK)], [_seg(0)]
    assert plan_regions(src, dst, [0, 1], [0, 1]) == [
        Region(0, 0, BLOCK),
        Region(2 * BLOCK, BLOCK, BLOCK),
    ]


def test_regions_for_several_layers_and_tensors():
    # Two layers, each a K and a V segment, placed far apart on both sides.
    src = [_seg(1_000_000 * i) for i in range(4)]
    dst = [_seg(5_000_000 + 1_000_000 * i) for i in range(4)]
    regions = plan_regions(src, dst, [2, 3, 9], [0, 1, 7])
    assert len(regions) == 8  # per segment: the run 2-3 → 0-1 and the lone 9 → 7
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        assert regions[2 * i] == Region(s.base_addr + 2 * BLOCK, d.base_addr, 2 * BLOCK)
        assert regions[2 * i + 1] == Region(s.base_addr + 9 * BLOCK, d.base_addr + 7 * BLOCK, BLOCK)


def test_real_kv_tensor_layout_plans_per_k_and_v():
    # A (2, num_blocks, block_size, heads, head_dim) float32 layer, as vLLM allocates it.
    num_blocks, block_size, heads, head_dim, itemsize = 8, 4, 2, 8, 4
    shape = (2, num_blocks, block_size, heads, head_dim)
    block_elems = block_size * heads * head_dim
    strides = (num_blocks * block_elems, block_elems, heads * head_dim, head_dim, 1)
    block_bytes = block_elems * itemsize
    src = tensor_segments(0x10000, shape, strides, itemsize, num_blocks)
    dst = tensor_segments(0x90000, shape, strides, itemsize, num_blocks)
    assert src == [
        MemSegment(0x10000, block_bytes, block_bytes),
        MemSegment(0x10000 + num_blocks * block_bytes, block_bytes, block_bytes),
    ]
    regions = plan_regions(src, dst, [1, 2, 3], [5, 6, 7])
    assert regions == [
        Region(0x10000 + block_bytes, 0x90000 + 5 * block_bytes, 3 * block_bytes),
        Region(
            0x10000 + (num_blocks + 1) * block_bytes,
            0x90000 + (num_blocks + 5) * block_bytes,
            3 * block_bytes,
        ),
    ]


def test_non_contiguous_block_interior_is_refused():
    with pytest.raises(PlanError, match="not contiguous"):
        tensor_segments(0, (4, 2, 8), (16, 1, 2), 4, num_blocks=4)


def test_tensor_without_a_block_dimension_is_refused():
    with pytest.raises(PlanError, match="num_blocks=5"):
        tensor_segments(0, (4, 8), (8, 1), 4, num_blocks=5)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [
        ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),
        ([0, 2, 4, 6], [1, 3, 5, 7]),
        ([7, 1, 2, 9, 10, 11, 3], [0, 1, 2, 5, 6, 7, 12]),
    ],
)
def test_region_bytes_equal_the_sum_of_block_bytes(src_ids, dst_ids):
    src = [_seg(0, block_len=BLOCK), _seg(10_000, stride=128, block_len=96)]
    dst = [_seg(50_000, block_len=BLOCK), _seg(90_000, stride=96, block_len=96)]
    regions = plan_regions(src, dst, src_ids, dst_ids)
    assert sum(r.length for r in regions) == len(src_ids) * (BLOCK + 96)


@pytest.mark.parametrize(
    ("src", "dst", "src_ids", "dst_ids", "match"),
    [
        ([_seg(0)], [_seg(0), _seg(1000)], [0], [0], "1 remote segments vs 2 local"),
        ([_seg(0)], [_seg(0)], [0, 1], [0], "2 remote blocks vs 1 local"),
        ([_seg(0, block_len=32)], [_seg(0)], [0], [0], "block length 32"),
    ],
)
def test_mismatched_plans_are_refused(src, dst, src_ids, dst_ids, match):
    with pytest.raises(PlanError, match=match):
        plan_regions(src, dst, src_ids, dst_ids)


# ---- protocol: the handoff ------------------------------------------------------------------

HASH = compat_hash(model="tiny", dtype="float32", block_size=16, tp_size=2)


def _handoff(**overrides) -> Handoff:
    fields = {
        "transfer_id": "t-1",
        "producer_engine_id": "prefill-0",
        "side_channel_host": "10.0.0.1",
        "side_channel_ports": [20001, 20003],
        "remote_block_ids": [4, 5, 9],
        "prompt_len": 40,
        "block_size": 16,
        "compat_hash": HASH,
    }
    return Handoff(**{**fields, **overrides})


def test_handoff_round_trip_through_params():
    h = _handoff()
    params = h.to_params()
    assert params["do_remote_prefill"] is True
    assert params["version"] == PROTOCOL_VERSION
    # It travels through the proxy as JSON.
    assert parse_handoff(json.loads(json.dumps(params))) == h


def test_handoff_ignores_fields_it_does_not_know():
    params = {**_handoff().to_params(), "added_in_a_later_minor": 1}
    assert parse_handoff(params) == _handoff()


@pytest.mark.parametrize(
    "field",
    ["transfer_id", "producer_engine_id", "remote_block_ids", "prompt_len", "compat_hash"],
)
def test_handoff_missing_field(field):
    params = _handoff().to_params()
    del params[field]
    with pytest.raises(HandoffError, match=field):
        parse_handoff(params)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_len", "40"),
        ("remote_block_ids", [4, "5"]),
        ("remote_block_ids", 4),
        ("side_channel_ports", "20001"),
        ("transfer_id", 7),
        ("block_size", 16.5),
        ("do_remote_prefill", "yes"),
    ],
)
def test_handoff_wrong_type(field, value):
    params = {**_handoff().to_params(), field: value}
    with pytest.raises(HandoffError, match="malformed kv_transfer_params"):
        parse_handoff(params)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"version": PROTOCOL_VERSION + 1}, "version"),
        ({"transfer_id": ""}, "empty transfer_id"),
        ({"producer_engine_id": ""}, "empty producer_engine_id"),
        ({"side_channel_ports": []}, "go together"),
        ({"side_channel_host": ""}, "go together"),
    ],
)
def test_unusable_handoff_is_refused(overrides, match):
    with pytest.raises(HandoffError, match=match):
        parse_handoff({**_handoff().to_params(), **overrides})


def test_handoff_without_side_channel_is_looked_up_by_engine_id():
    h = parse_handoff({**_handoff().to_params(), "side_channel_host": "", "side_channel_ports": []})
    assert h.producer_engine_id == "prefill-0"
    _validate(h)  # no TP-rank count to compare: the registry has it


@pytest.mark.parametrize("params", [None, [], "t-1", {}])
def test_handoff_that_is_not_an_object(params):
    with pytest.raises(HandoffError):
        parse_handoff(params)


def _validate(h: Handoff, **overrides) -> None:
    request = {"prompt_len": 40, "block_size": 16, "compat_hash": HASH, "tp_size": 2}
    validate_handoff(h, **{**request, **overrides})


def test_matching_handoff_validates():
    _validate(_handoff())
    _validate(_handoff(prompt_len=48, remote_block_ids=[1, 2, 3]), prompt_len=48)  # full blocks
    _validate(_handoff(prompt_len=33, remote_block_ids=[1, 2, 3]), prompt_len=33)


@pytest.mark.parametrize(
    ("handoff", "request_overrides", "match"),
    [
        (_handoff(compat_hash=compat_hash(model="other")), {}, "compat hash mismatch"),
        (_handoff(), {"compat_hash": compat_hash(model="other")}, "compat hash mismatch"),
        (_handoff(), {"prompt_len": 41}, "prompt length 41 differs from the producer's 40"),
        (_handoff(prompt_len=41), {}, "prompt length 40 differs from the producer's 41"),
        (_handoff(remote_block_ids=[4, 5]), {}, "2 remote blocks for 40 tokens, expected 3"),
        (_handoff(remote_block_ids=[4, 5, 9, 10]), {}, "4 remote blocks for 40 tokens"),
        (_handoff(block_size=32), {}, "block size 16 differs from the producer's 32"),
        (_handoff(side_channel_ports=[20001]), {}, "producer has 1 TP ranks, consumer 2"),
    ],
)
def test_mismatching_handoff_is_refused(handoff, request_overrides, match):
    with pytest.raises(HandoffError, match=match):
        _validate(handoff, **request_overrides)


COMPAT_FIELDS = {
    "model": "tiny",
    "dtype": "float32",
    "kv_dtype": "auto",
    "block_size": 16,
    "tp_size": 2,
    "layout": "NHD",
}


def test_compat_hash_is_stable():
    assert compat_hash(**COMPAT_FIELDS) == compat_hash(**COMPAT_FIELDS)
    assert compat_hash(**COMPAT_FIELDS) == compat_hash(**dict(reversed(COMPAT_FIELDS.items())))
    assert len(compat_hash(**COMPAT_FIELDS)) == 64  # sha256 hex


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "tiny-2"),
        ("dtype", "bfloat16"),
        ("kv_dtype", "fp8"),
        ("block_size", 32),
        ("block_size", "16"),
        ("tp_size", 1),
        ("layout", "HND"),
        ("extra", None),
    ],
)
def test_compat_hash_changes_with_any_input(field, value):
    assert compat_hash(**{**COMPAT_FIELDS, field: value}) != compat_hash(**COMPAT_FIELDS)


# ---- protocol: side-channel frames ----------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        Acquire("t-1", [4, 5, 9]),
        Granted("t-1", "10.0.0.1:20000", [MemSegment(0x1000, 4096, 2048), MemSegment(0, 64, 64)]),
        Granted("t-1", "10.0.0.1:20000", []),
        Refused("t-1", "transfer t-1 already expired"),
        Release("t-1", ok=True),
        Release("t-1", ok=False),
        Released("t-1"),
    ],
    ids=lambda f: type(f).__name__,
)
def test_frame_round_trip(frame):
    decoded = decode_frame(encode_frame(frame))
    assert type(decoded) is type(frame)
    assert decoded == frame


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"transfer_id": "t-1"}),  # no tag
        msgspec.msgpack.encode({"type": "acquire_v2", "transfer_id": "t-1"}),  # unknown kind
        msgspec.msgpack.encode({"type": "release/1", "transfer_id": "t-1"}),  # field missing
        msgspec.msgpack.encode({"type": "release/1", "transfer_id": "t-1", "ok": "yes"}),
        msgspec.msgpack.encode({"type": "release/2", "transfer_id": "t-1", "ok": True}),  # version
        encode_frame(Released("t-1"))[:-2],  # truncated
    ],
    ids=repr,
)
def test_malformed_frame_is_rejected(data):
    # msgspec.ValidationError is a DecodeError: one except clause covers both.
    with pytest.raises(msgspec.DecodeError):
        decode_frame(data)


# ---- leases ---------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _table(clock, ttl_s=10.0, budget_bytes=1000, pull_hold_s=5.0) -> LeaseTable:
    return LeaseTable(ttl_s, budget_bytes, pull_hold_s, clock=clock)


def test_hold_acquire_release(clock):
    t = _table(clock)
    t.add("req-1", "t-1", [3, 4], nbytes=100)
    assert (t.held_count, t.held_bytes) == (1, 100)
    assert t.take_finished() == set()  # held blocks are not freed

    lease = t.acquire("t-1", [3, 4])
    assert lease.state is LeaseState.PULLING
    assert (lease.req_id, lease.block_ids) == ("req-1", [3, 4])

    assert t.release("t-1") is True
    assert lease.state is LeaseState.ENDED
    assert lease.end_reason == "released"
    assert (t.held_count, t.held_bytes) == (0, 0)
    assert t.take_finished() == {"req-1"}
    assert t.take_finished() == set()  # reported once
    assert t.ended_counts == {"released": 1}


def test_acquire_of_unknown_id_is_not_refused_yet(clock):
    # The handoff may reach the consumer before the producer's worker registers the lease.
    assert _table(clock).acquire("t-unknown", [1]) is None


def test_acquire_of_part_of_the_lease(clock):
    t = _table(clock)
    t.add("req-1", "t-1", [3, 4, 5], nbytes=100)
    assert t.acquire("t-1", [4, 5]).state is LeaseState.PULLING


def test_acquire_of_blocks_outside_the_lease_is_refused(clock):
    t = _table(clock)
    t.add("req-1", "t-1", [3, 4], nbytes=100)
    reason = t.acquire("t-1", [4, 7])
    assert isinstance(reason, str)
    assert "not part of the lease" in reason
    assert t.acquire("t-1", [3, 4]).state is LeaseState.PULLING  # the lease itself is intact


def test_second_acquire_while_pulling_is_refused(clock):
    t = _table(clock)
    t.add("req-1", "t-1", [3], nbytes=100)
    t.acquire("t-1", [3])
    assert t.acquire("t-1", [3]) == "transfer t-1 is already being pulled"


def test_release_of_unknown_id(clock):
    t = _table(clock)
    assert t.release("t-unknown") is False
    assert t.take_finished() == set()


def test_held_lease_expires_after_ttl(clock):
    t = _table(clock, ttl_s=10.0)
    t.add("req-1", "t-1", [3], nbytes=100)
    clock.now_s += 9.9
    t.expire()
    assert t.held_count == 1
    clock.now_s += 0.1
    t.expire()
    assert t.held_count == 0
    assert t.take_finished() == {"req-1"}
    assert t.ended_counts == {"expired": 1}


def test_pulling_lease_expires_at_its_pull_deadline_not_its_ttl(clock):
    t = _table(clock, ttl_s=10.0, pull_hold_s=30.0)
    t.add("req-1", "t-1", [3], nbytes=100)
    clock.now_s += 9.0
    t.acquire("t-1", [3])  # pull deadline: now + 30
    clock.now_s += 20.0  # past the TTL
    t.expire()
    assert t.held_count == 1
    clock.now_s += 10.0
    t.expire()
    assert t.held_count == 0
    assert t.take_finished() == {"req-1"}


@pytest.mark.parametrize("end", ["release", "expire", "evict"])
def test_pull_of_an_ended_lease_is_refused_with_the_reason(clock, end):
    t = _table(clock, ttl_s=10.0, budget_bytes=150)
    t.add("req-1", "t-1", [3], nbytes=100)
    if end == "release":
        t.release("t-1")
        reason = "released"
    elif end == "expire":
        clock.now_s += 10.0
        t.expire()
        reason = "expired"
    else:
        t.add("req-2", "t-2", [4], nbytes=100)
        reason = "evicted"
    assert t.acquire("t-1", [3]) == f"transfer t-1 already {reason}"
    assert "req-1" in t.take_finished()


def test_budget_evicts_oldest_first(clock):
    t = _table(clock, budget_bytes=300)
    for i in range(3):
        t.add(f"req-{i}", f"t-{i}", [i], nbytes=100)
    assert (t.held_count, t.take_finished()) == (3, set())  # exactly at budget

    t.add("req-3", "t-3", [3], nbytes=150)  # 450 held: the two oldest go
    assert t.held_bytes == 250
    assert t.take_finished() == {"req-0", "req-1"}
    assert t.acquire("t-0", [0]) == "transfer t-0 already evicted"
    assert t.acquire("t-2", [2]).state is LeaseState.PULLING
    assert t.ended_counts == {"evicted": 2}


def test_budget_never_evicts_a_lease_being_pulled(clock):
    t = _table(clock, budget_bytes=200)
    t.add("req-0", "t-0", [0], nbytes=100)
    t.add("req-1", "t-1", [1], nbytes=100)
    t.acquire("t-0", [0])
    t.add("req-2", "t-2", [2], nbytes=100)  # oldest is pulling: the next oldest held one goes
    assert t.take_finished() == {"req-1"}
    assert t.release("t-0") is True


def test_lease_larger_than_the_budget_is_freed_at_once(clock):
    t = _table(clock, budget_bytes=100)
    t.add("req-0", "t-0", [0], nbytes=500)
    assert t.held_count == 0
    assert t.take_finished() == {"req-0"}  # its blocks are freed, not leaked


def test_duplicate_transfer_id_supersedes_the_older_lease(clock):
    t = _table(clock)
    t.add("req-old", "t-1", [3, 4], nbytes=100)
    t.add("req-new", "t-1", [7, 8], nbytes=100)
    assert (t.held_count, t.held_bytes) == (1, 100)
    assert t.take_finished() == {"req-old"}  # the older request's blocks are freed
    assert t.ended_counts == {"superseded": 1}

    lease = t.acquire("t-1", [7, 8])
    assert lease.req_id == "req-new"
    assert t.acquire("t-1", [3]) == "transfer t-1 is already being pulled"
    t.release("t-1")
    assert t.take_finished() == {"req-new"}


def test_superseding_lease_restarts_the_budget_order(clock):
    t = _table(clock, budget_bytes=200)
    t.add("req-a", "t-a", [0], nbytes=100)
    t.add("req-b", "t-b", [1], nbytes=100)
    t.add("req-a2", "t-a", [2], nbytes=100)  # t-a is now the newest
    assert t.take_finished() == {"req-a"}
    t.add("req-c", "t-c", [3], nbytes=100)
    assert t.take_finished() == {"req-b"}  # oldest remaining, not the re-added t-a


def test_ended_ids_are_remembered_up_to_a_bound(clock):
    t = LeaseTable(10.0, 10_000, 5.0, clock=clock, remember_ended=2)
    for i in range(3):
        t.add(f"req-{i}", f"t-{i}", [i], nbytes=1)
        t.release(f"t-{i}")
    assert t.acquire("t-0", [0]) is None  # forgotten: the side channel treats it as unknown
    assert t.acquire("t-2", [2]) == "transfer t-2 already released"


def test_real_clock_with_a_tiny_ttl():
    t = LeaseTable(ttl_s=0.0, budget_bytes=1000, pull_hold_s=1.0)
    t.add("req-1", "t-1", [3], nbytes=100)
    t.expire()
    assert t.take_finished() == {"req-1"}


def test_stats_sum_counters_and_keep_the_newest_held_lease_count():
    from mooncake_vllm.stats import MooncakeStats

    worker, sched_a, sched_b = MooncakeStats(), MooncakeStats(), MooncakeStats()
    worker.record_pull(1000, 2, 3, duration_s=0.01, acquire_s=0.002, read_s=0.008)
    sched_a.count("released")
    sched_a.data["held_leases"] = 4
    sched_b.data["held_leases"] = 0
    assert MooncakeStats().is_empty()
    assert not sched_b.is_empty()  # a count that dropped to zero must still be reported
    total = worker.aggregate(sched_a).aggregate(sched_b)
    reduced = total.reduce()
    assert (reduced["pulls"], reduced["released"], reduced["held_leases"]) == (1, 1, 0)
    assert reduced["MB"] == 0.001


def test_blocks_under_a_pull_are_not_reused_until_every_rank_settled():
    from vllm.v1.core.block_pool import BlockPool

    from mooncake_vllm.scheduler import BlockPins

    pool = BlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=16)
    free0 = pool.get_num_free_blocks()
    blocks = pool.get_new_blocks(3)  # the request's allocation
    pins = BlockPins(pool, tp_size=2)
    pins.pin("req-1", [b.block_id for b in blocks])
    pool.free_blocks(blocks)  # vLLM fails the request at the deadline and frees its blocks
    assert pool.get_num_free_blocks() == free0 - 3  # still pinned: not handed out again
    pins.settle(["req-1", "req-unknown"])  # rank 0 settled
    assert (pool.get_num_free_blocks(), len(pins)) == (free0 - 3, 1)
    pins.settle(["req-1"])  # rank 1 settled: every entry has ended
    assert (pool.get_num_free_blocks(), len(pins)) == (free0, 0)
