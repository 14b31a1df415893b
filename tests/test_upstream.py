"""vLLM's upstream MooncakeConnector convention: transfer ids, the decode's params, the producer's
bootstrap service (a real process on a free port) and the consumer's resolver."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
import uuid

import pytest

from harness.servers import free_port
from mooncake_vllm.core.settings import ConfigError
from mooncake_vllm.p2p import bootstrap, protocol, upstream
from mooncake_vllm.p2p.bootstrap import BootstrapRegistration, BootstrapService
from mooncake_vllm.p2p.config import bootstrap_port, load_settings, resolve
from mooncake_vllm.p2p.upstream import BootstrapError, BootstrapResolver

XFER = f"xfer-{uuid.uuid4()}"
# A version-7 UUID (RFC 9562: 48-bit milliseconds, version 7, 74 random bits); Python 3.11 has
# no uuid.uuid7.
UUID7 = "01938e4f-7a2b-7c3d-9e4f-5a6b7c8d9e0f"


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("ab" * 16, True),  # our proxy's
        (XFER, True),  # vLLM's proxy, llm-d
        (str(uuid.uuid4()), True),  # Dynamo's
        (str(uuid.uuid1()), True),  # upstream takes any id its orchestrator sends
        (UUID7, True),
        (f"xfer-{UUID7}", True),
        (f"xfer-{uuid.uuid4()}".upper(), True),
        ("xfer-123", True),
        ("xfer-cmpl-1a2b:0.5", True),
        ("t" * 128, True),
        ("t" * 129, False),  # bounded length
        ("", False),
        ("xfer- 1", False),  # bounded charset
        ("xfer-\n", False),
        ("ü", False),
        (None, False),
        (7, False),
    ],
)
def test_a_producer_takes_any_bounded_transfer_id_as_upstream_does(value, ok):
    assert protocol.is_transfer_id(value) is ok


def upstream_params(**change) -> dict:
    params = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": XFER,
              "remote_bootstrap_addr": "http://127.0.0.2:8998",
              "remote_engine_id": "e-1"}  # fmt: skip
    return {**params, **change}


def test_every_convention_of_a_decode_leg_parses_to_our_handoffs():
    pending = upstream.parse_consumer_params(upstream_params())
    assert isinstance(pending, protocol.PendingHandoff) and pending.unresolved
    assert pending.bootstrap_addr == "http://127.0.0.2:8998"
    ours = protocol.PendingHandoff(
        transfer_id="ab" * 16,
        producer_engine_id="p",
        side_channel_host="127.0.0.2",
        side_channel_ports=[13004],
        producer_tp_size=1,
    )
    assert upstream.parse_consumer_params(ours.to_params()) == ours
    handoff = protocol.Handoff(
        transfer_id="t", producer_engine_id="p", side_channel_host="h", side_channel_ports=[1],
        producer_tp_size=1, remote_block_ids=[1], prompt_len=3, block_size=16, compat_hash="c",
    )  # fmt: skip
    # A producer's answer carries upstream's keys too: still our full handoff on the decode.
    answer = upstream.producer_params(handoff, "http://h:8998")
    assert answer["remote_engine_id"] == "p" and answer["remote_bootstrap_addr"] == "http://h:8998"
    assert upstream.parse_consumer_params(answer) == handoff


@pytest.mark.parametrize(
    "addr",
    ["127.0.0.2:8998", "http://127.0.0.2", "ftp://h:1", "http://h:1/x", "http://u@h:1", 7],
)
def test_a_malformed_bootstrap_address_is_refused_naming_it(addr):
    with pytest.raises(protocol.HandoffError, match="remote_bootstrap_addr"):
        upstream.to_pending(upstream_params(remote_bootstrap_addr=addr))


def test_the_query_answer_has_upstreams_shape_and_parses_back():
    body = upstream.query_body("e-1", 0, "127.0.0.2", [13004, 13006])
    assert json.loads(json.dumps(body)) == {
        "0": {
            "engine_id": "e-1",
            "worker_addr": {
                "0": {"0": "tcp://127.0.0.2:13004"},
                "1": {"0": "tcp://127.0.0.2:13006"},
            },
        }
    }
    (producer,) = upstream.parse_query(json.loads(json.dumps(body))).values()
    assert producer == upstream.Producer("e-1", "127.0.0.2", [13004, 13006], 2, 1)


@pytest.mark.parametrize(
    "data",
    [[], {"0": {}}, {"0": {"engine_id": "e", "worker_addr": {"1": {"0": "tcp://h:1"}}}},
     {"0": {"engine_id": "e", "worker_addr": {"0": {"0": "h:1"}}}}],
)  # fmt: skip
def test_a_malformed_query_answer_is_refused(data):
    with pytest.raises(protocol.HandoffError):
        upstream.parse_query(data)


def test_the_bootstrap_port_comes_from_the_setting_then_vllms_variable_then_8998():
    s = load_settings({}, env={})
    assert bootstrap_port(s, env={}) == 8998
    assert bootstrap_port(s, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9100"}) == 9100
    s = load_settings({"bootstrap_port": 0}, env={})
    assert bootstrap_port(s, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9100"}) == 0
    with pytest.raises(ConfigError, match="VLLM_MOONCAKE_BOOTSTRAP_PORT='x'"):
        bootstrap_port(load_settings({}, env={}), env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "x"})
    consumer = resolve(load_settings({}, env={}), "kv_consumer", "d", 1, env={})
    assert consumer.bootstrap_port == 0  # only producers serve one


def producer_cfg(port: int, engine_id: str = "e-1", tp: int = 2, host: str = "127.0.0.1"):
    settings = load_settings({"prefill_url": f"{host}:15000", "bootstrap_port": port}, env={})
    return resolve(settings, "kv_producer", engine_id, tp)


@pytest.fixture
def boot_port() -> int:
    return free_port("127.0.0.1")


def test_the_bootstrap_service_answers_query_and_refuses_register(boot_port):
    service = BootstrapService(producer_cfg(boot_port))
    try:
        with urllib.request.urlopen(f"{service.url}/query", timeout=5) as resp:
            data = json.loads(resp.read())
        assert data == upstream.query_body("e-1", 0, "127.0.0.1", [15001, 15003])
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(
                urllib.request.Request(f"{service.url}/register", data=b"{}", method="POST"),
                timeout=5,
            )
        assert err.value.code == 403
    finally:
        service.close()
    with pytest.raises(urllib.error.URLError):  # gone with its owner
        urllib.request.urlopen(f"http://127.0.0.1:{boot_port}/query", timeout=2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_group_signal_leaves_the_bootstrap_answering_until_its_engine_core_ends_it(
    boot_port, signum
):
    """A signal to vLLM's process group reaches the bootstrap process while its engine core
    drains: ``/query`` still answers; closing the service (the engine core's teardown) ends it."""
    service = BootstrapService(producer_cfg(boot_port))
    try:
        os.kill(service._proc.pid, signum)
        time.sleep(0.3)
        assert service._proc.poll() is None, "the bootstrap exited on a group signal"
        with urllib.request.urlopen(f"{service.url}/query", timeout=5) as resp:
            assert json.loads(resp.read())["0"]["engine_id"] == "e-1"
    finally:
        service.close()
    assert service._proc.poll() is not None


def test_a_second_engine_on_the_same_bootstrap_port_stops_naming_the_setting(boot_port):
    first = BootstrapService(producer_cfg(boot_port))
    try:
        with pytest.raises(ConfigError) as err:
            BootstrapService(producer_cfg(boot_port, "e-2"))
        assert f"127.0.0.1:{boot_port}" in str(err.value) and "bootstrap_port" in str(err.value)
        assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" in str(err.value)
    finally:
        first.close()


def dp_cfg(port: int, dp_rank: int, tp: int = 2, host: str = "127.0.0.1"):
    """DP rank ``dp_rank`` of a ``--data-parallel-size`` engine on one host (vLLM names its
    engine ``<engine_id>_dp<rank>``)."""
    settings = load_settings({"prefill_url": f"{host}:15000", "bootstrap_port": port}, env={})
    return resolve(
        settings, "kv_producer", f"e_dp{dp_rank}", tp, dp_rank=dp_rank, dp_local_rank=dp_rank
    )


def test_a_bootstrap_server_address_wins_as_upstreams_connector_reads_it():
    settings = load_settings(
        {"prefill_url": "127.0.0.2:15000", "bootstrap_server_address": "127.0.0.2:9100"}, env={}
    )
    cfg = resolve(settings, "kv_producer", "e", 1, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9200"})
    assert (cfg.bootstrap_listen_host, cfg.bootstrap_port) == ("127.0.0.2", 9100)
    with pytest.raises(ConfigError, match="bootstrap_server_address='9100' must be 'host:port'"):
        load_settings({"bootstrap_server_address": "9100"}, env={})


def test_local_dp_ranks_take_consecutive_ports_and_only_the_first_serves_the_bootstrap():
    ranks = [dp_cfg(8998, r) for r in range(3)]
    assert [c.base_port for c in ranks] == [15000, 15004, 15008]  # 2 ports per TP rank each
    assert [c.side_channel_port(1) for c in ranks] == [15003, 15007, 15011]
    assert [c.serves_bootstrap for c in ranks] == [True, False, False]


def query(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/query", timeout=5) as resp:
        return json.loads(resp.read())


def test_every_local_dp_rank_is_listed_by_the_first_ones_bootstrap(boot_port):
    later = BootstrapRegistration(dp_cfg(boot_port, 1))  # DP engines start in any order
    service = BootstrapService(dp_cfg(boot_port, 0))
    try:
        want = upstream.query_body("e_dp0", 0, "127.0.0.1", [15001, 15003])
        want |= upstream.query_body("e_dp1", 1, "127.0.0.1", [15005, 15007])
        deadline = time.monotonic() + 10
        while query(service.url) != want:
            assert time.monotonic() < deadline, query(service.url)
            time.sleep(0.1)
        assert sorted(upstream.parse_query(query(service.url))) == ["e_dp0", "e_dp1"]
    finally:
        later.close()
        service.close()


def test_a_registration_is_taken_only_for_a_new_rank_on_the_bootstraps_host():
    listed = upstream.query_body("e_dp0", 0, "127.0.0.1", [15001])
    entry = upstream.query_body("e_dp1", 1, "127.0.0.1", [15003])
    assert bootstrap.take_entry(listed, json.dumps(entry).encode(), "127.0.0.1") == ""
    assert "DP rank 1 is listed already" in bootstrap.take_entry(
        listed, json.dumps(entry).encode(), "127.0.0.1"
    )
    elsewhere = upstream.query_body("e_dp2", 2, "10.0.0.9", [15005])
    assert "on 127.0.0.1" in bootstrap.take_entry(
        listed, json.dumps(elsewhere).encode(), "127.0.0.1"
    )
    assert "malformed" in bootstrap.take_entry(listed, b"{nope", "127.0.0.1")
    assert sorted(listed) == ["0", "1"]


def pending(addr: str, engine_id: str = "e-1") -> protocol.PendingHandoff:
    return upstream.to_pending(
        upstream_params(remote_bootstrap_addr=addr, remote_engine_id=engine_id)
    )


def test_the_resolver_caches_per_engine_and_asks_again_after_a_restart(boot_port):
    asked = []

    def fetch(addr, timeout_s):
        asked.append(addr)
        return upstream.fetch_query(addr, timeout_s)

    resolver, addr = BootstrapResolver(fetch), f"http://127.0.0.1:{boot_port}"
    service = BootstrapService(producer_cfg(boot_port))
    try:
        for _ in range(3):
            h = resolver.resolve(pending(addr), timeout_s=5)
        assert (h.side_channel_host, h.side_channel_ports, h.producer_tp_size) == (
            "127.0.0.1",
            [15001, 15003],
            2,
        )
        assert not h.unresolved and len(asked) == 1  # cached
    finally:
        service.close()
    # The prefill restarted: a new engine id behind the same address is asked for.
    service = BootstrapService(producer_cfg(boot_port, "e-2", tp=1))
    try:
        h = resolver.resolve(pending(addr, "e-2"), timeout_s=5)
        assert (h.side_channel_ports, len(asked)) == ([15001], 2)
        with pytest.raises(BootstrapError, match=r"unknown remote_engine_id 'e-1'.*\['e-2'\]"):
            resolver.resolve(pending(addr, "e-1"), timeout_s=5)  # the old one: asked, unknown
        assert len(asked) == 3
    finally:
        service.close()


def test_a_bootstrap_that_does_not_answer_is_named(boot_port):
    addr = f"http://127.0.0.1:{boot_port}"  # nothing listens
    with pytest.raises(BootstrapError, match=f"the bootstrap {addr} did not answer /query"):
        BootstrapResolver().resolve(pending(addr), timeout_s=2)
