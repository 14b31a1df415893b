"""The side channel over real ZeroMQ sockets on loopback (no vLLM, no transfer engine)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.servers import free_port
from mooncake_vllm.leases import LeaseTable
from mooncake_vllm.protocol import Acquire, Granted, MemSegment, Refused, Release, Released
from mooncake_vllm.side_channel import SideChannelClient, SideChannelError, SideChannelServer

SEGMENTS = [MemSegment(0x1000, 4096, 4096)]


@pytest.fixture
def producer():
    leases = LeaseTable(ttl_s=30, budget_bytes=1 << 30, pull_hold_s=30)
    port = free_port()
    server = SideChannelServer(
        "127.0.0.1", port, leases, layout=lambda: ("127.0.0.1:9", SEGMENTS), max_idle_s=0.2
    )
    client = SideChannelClient()
    yield leases, f"127.0.0.1:{port}", client
    client.close()
    server.close()


def test_acquire_and_release(producer):
    leases, address, client = producer
    leases.add("req-1", "t-1", [3, 4], nbytes=8192)
    reply = client.call(address, Acquire("t-1", [3, 4]), timeout_s=5)
    assert reply == Granted("t-1", "127.0.0.1:9", SEGMENTS)
    assert client.call(address, Release("t-1", True), timeout_s=5) == Released("t-1")
    assert leases.take_finished() == {"req-1"}


def test_unknown_transfer_id_is_refused_at_once(producer):
    # The producer holds a lease before its handoff exists: an unknown id is never "not yet".
    _, address, client = producer
    start = time.monotonic()
    reply = client.call(address, Acquire("nope", [1]), timeout_s=5)
    assert isinstance(reply, Refused)
    assert "unknown transfer id nope" in reply.reason
    assert time.monotonic() - start < 0.5


def test_concurrent_acquires_to_one_producer_are_answered_independently(producer):
    leases, address, client = producer
    for i in range(8):
        leases.add(f"req-{i}", f"t-{i}", [i], nbytes=4096)
    with ThreadPoolExecutor(8) as pool:
        replies = list(
            pool.map(lambda i: client.call(address, Acquire(f"t-{i}", [i]), 5), range(8))
        )
    assert all(isinstance(r, Granted) for r in replies)
    assert [r.transfer_id for r in replies] == [f"t-{i}" for i in range(8)]


def test_an_expiring_lease_is_ended_by_the_server_thread_without_a_request():
    ended = threading.Event()
    leases = LeaseTable(ttl_s=0.3, budget_bytes=1 << 30, pull_hold_s=30, on_end=ended.set)
    server = SideChannelServer("127.0.0.1", free_port(), leases, layout=lambda: ("x:1", SEGMENTS))
    try:
        leases.add("req-1", "t-1", [1], nbytes=1)
        assert ended.wait(3), "the lease did not expire"
        assert leases.take_finished() == {"req-1"}
    finally:
        server.close()


def test_no_answer_is_an_error_within_the_timeout():
    client = SideChannelClient()
    try:
        start = time.monotonic()
        with pytest.raises(SideChannelError, match="no answer"):
            client.call(f"127.0.0.1:{free_port()}", Release("t", True), timeout_s=0.5)
        assert time.monotonic() - start < 2
    finally:
        client.close()
