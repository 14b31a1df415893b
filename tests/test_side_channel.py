"""The side channel over real ZeroMQ sockets on loopback, served by a real lease server process
(no vLLM, no transfer engine)."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq

from harness.servers import free_port
from mooncake_vllm.config import load_settings, resolve
from mooncake_vllm.lease_service import LeaseService, RankLayout
from mooncake_vllm.local_channels import wake_endpoint
from mooncake_vllm.protocol import Acquire, Granted, MemSegment, Refused, Release, Released
from mooncake_vllm.side_channel import SideChannelClient, SideChannelError

SEGMENTS = [MemSegment(0x1000, 4096, 4096)]
ROOT = Path(__file__).resolve().parents[1]


def producer_config(port: int, **settings):
    """A producer whose side channel binds ``port`` (the side channel is base port + 1)."""
    extra = {"prefill_url": f"127.0.0.1:{port - 1}", **settings}
    return resolve(load_settings(extra, env={}), "kv_producer", "prefill", 1)


def start_service(port: int, **settings) -> LeaseService:
    cfg = producer_config(port, **settings)
    service = LeaseService(cfg, wake_endpoint(cfg.host, cfg.base_port))
    service.set_layouts({0: RankLayout("127.0.0.1:9", SEGMENTS, worker_pid=0)})
    return service


@pytest.fixture
def producer():
    port = free_port()
    service, client = start_service(port), SideChannelClient()
    yield service, f"127.0.0.1:{port}", client
    client.close()
    service.close()


def test_a_hold_is_granted_at_once_and_its_release_is_known_before_the_consumer_hears_it(producer):
    # The hold travels to the lease server beside the acquire; neither waits for the other.
    service, address, client = producer
    assert service.hold("req-1", "t-1", [3, 4])
    reply = client.call(address, Acquire("t-1", [3, 4]), timeout_s=5)
    assert reply == Granted("t-1", "127.0.0.1:9", SEGMENTS)
    assert service.held_count == 1
    assert client.call(address, Release("t-1", True), timeout_s=5) == Released("t-1")
    assert service.take_finished() == {"req-1"}  # reported before the Released reply left
    assert service.take_ended_counts() == {"released": 1}
    assert (service.held_count, service.held_bytes) == (0, 0)


def test_unknown_transfer_id_is_refused_at_once(producer):
    # The producer holds a lease before its handoff exists: an unknown id is never "not yet".
    _, address, client = producer
    start = time.monotonic()
    reply = client.call(address, Acquire("nope", [1]), timeout_s=5)
    assert isinstance(reply, Refused)
    assert "unknown transfer id nope" in reply.reason
    assert time.monotonic() - start < 0.5


def test_concurrent_acquires_to_one_producer_are_answered_independently(producer):
    service, address, client = producer
    for i in range(8):
        service.hold(f"req-{i}", f"t-{i}", [i])
    with ThreadPoolExecutor(8) as pool:
        replies = list(
            pool.map(lambda i: client.call(address, Acquire(f"t-{i}", [i]), 5), range(8))
        )
    assert all(isinstance(r, Granted) for r in replies)
    assert [r.transfer_id for r in replies] == [f"t-{i}" for i in range(8)]


def test_an_expiring_lease_is_ended_without_a_request_and_wakes_the_engine_core():
    port = free_port()
    cfg = producer_config(port, lease_ttl_s=0.3)
    wake = zmq.Context.instance().socket(zmq.PULL)  # the engine core's wake-up socket
    wake.bind(wake_endpoint(cfg.host, cfg.base_port))
    service = start_service(port, lease_ttl_s=0.3)
    try:
        service.hold("req-1", "t-1", [1])
        assert wake.poll(3000), "the lease did not expire, or nobody woke the engine core"
        assert service.take_finished() == {"req-1"}
        assert service.take_ended_counts() == {"expired": 1}
    finally:
        service.close()
        wake.close()


def test_a_second_producer_on_the_same_port_is_refused_naming_the_port(producer):
    _, address, _ = producer
    port = int(address.rsplit(":", 1)[1])
    with pytest.raises(SideChannelError, match=f"cannot bind 127.0.0.1:{port}.*ports apart"):
        start_service(port)


def test_the_lease_server_ends_with_its_engine_core():
    # An engine core that dies without closing anything (SIGKILL, os._exit).
    script = (
        "import os, sys\n"
        "from tests.test_side_channel import start_service\n"
        f"service = start_service({free_port()})\n"
        "print(service._proc.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the lease server outlived its engine core"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_no_answer_is_an_error_within_the_timeout():
    client = SideChannelClient()
    try:
        start = time.monotonic()
        with pytest.raises(SideChannelError, match="no answer"):
            client.call(f"127.0.0.1:{free_port()}", Release("t", True), timeout_s=0.5)
        assert time.monotonic() - start < 2
    finally:
        client.close()


def test_the_lease_server_imports_neither_vllm_nor_torch():
    # Its start-up is on the engine core's start-up path, and its memory is per producer.
    code = (
        "import sys, mooncake_vllm.lease_server\n"
        "print(sorted(m for m in ('vllm', 'torch', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
