"""The side channel over real ZeroMQ sockets on loopback (no vLLM, no transfer engine)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mooncake_vllm.leases import LeaseTable
from mooncake_vllm.protocol import Acquire, Granted, MemSegment, Refused, Release, Released
from mooncake_vllm.side_channel import SideChannelClient, SideChannelError, SideChannelServer
from mooncake_vllm.testing.servers import free_port

SEGMENTS = [MemSegment(0x1000, 4096, 4096)]


@pytest.fixture
def producer():
    leases = LeaseTable(ttl_s=30, budget_bytes=1 << 30, pull_hold_s=30)
    port = free_port()
    server = SideChannelServer(
        "127.0.0.1", port, leases, layout=lambda: ("127.0.0.1:9", SEGMENTS), unknown_wait_s=1.5
    )
    client = SideChannelClient()
    yield leases, f"127.0.0.1:{port}", client
    client.close()
    server.close()


def test_acquire_and_release(producer):
    leases, address, client = producer
    leases.add("req-1", "t-1", [3, 4], nbytes=8192)
    reply = client.call(address, Acquire("t-1", "decode", [3, 4]), timeout_s=5)
    assert reply == Granted("t-1", "127.0.0.1:9", SEGMENTS)
    assert client.call(address, Release("t-1", True), timeout_s=5) == Released("t-1")
    assert leases.take_finished() == {"req-1"}


def test_unknown_transfer_id_is_refused_after_the_wait(producer):
    _, address, client = producer
    reply = client.call(address, Acquire("nope", "decode", [1]), timeout_s=5)
    assert isinstance(reply, Refused)
    assert "unknown transfer id nope" in reply.reason


def test_a_waiting_acquire_does_not_hold_up_other_calls_to_the_same_producer(producer):
    leases, address, client = producer
    leases.add("req-1", "t-1", [3], nbytes=4096)
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(client.call, address, Acquire("later", "decode", [5]), 5)
        time.sleep(0.2)  # the first acquire is now waiting for its lease on the producer
        start = time.monotonic()
        fast = pool.submit(client.call, address, Acquire("t-1", "decode", [3]), 5)
        assert isinstance(fast.result(), Granted)
        fast_s = time.monotonic() - start
        leases.add("req-2", "later", [5], nbytes=4096)  # the lease arrives: the first is granted
        assert isinstance(slow.result(), Granted)
    assert fast_s < 1.0, f"the second acquire waited {fast_s:.2f}s behind the first"


def test_no_answer_is_an_error_within_the_timeout():
    client = SideChannelClient()
    try:
        start = time.monotonic()
        with pytest.raises(SideChannelError, match="no answer"):
            client.call(f"127.0.0.1:{free_port()}", Release("t", True), timeout_s=0.5)
        assert time.monotonic() - start < 2
    finally:
        client.close()
