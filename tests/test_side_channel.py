"""The side channel over real ZeroMQ sockets on loopback (no vLLM, no transfer engine)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mooncake_vllm.leases import LeaseTable
from mooncake_vllm.local_channels import HoldSender, hold_endpoint
from mooncake_vllm.protocol import Acquire, Granted, Hold, MemSegment, Refused, Release, Released
from mooncake_vllm.side_channel import SideChannelClient, SideChannelError, SideChannelServer
from mooncake_vllm.testing.servers import free_port

SEGMENTS = [MemSegment(0x1000, 4096, 4096)]


@pytest.fixture
def producer():
    leases = LeaseTable(ttl_s=30, budget_bytes=1 << 30, pull_hold_s=30)
    port = free_port()
    server = SideChannelServer(
        "127.0.0.1",
        port,
        leases,
        layout=lambda: ("127.0.0.1:9", SEGMENTS),
        on_hold=lambda h: leases.add(h.req_id, h.transfer_id, h.block_ids, 4096),
        hold_endpoint=hold_endpoint("127.0.0.1", port),
        unknown_wait_s=1.5,
    )
    client = SideChannelClient()
    holds = HoldSender([hold_endpoint("127.0.0.1", port)])
    yield leases, f"127.0.0.1:{port}", client, holds
    holds.close()
    client.close()
    server.close()


def test_acquire_and_release(producer):
    leases, address, client, _ = producer
    leases.add("req-1", "t-1", [3, 4], nbytes=8192)
    reply = client.call(address, Acquire("t-1", "decode", [3, 4]), timeout_s=5)
    assert reply == Granted("t-1", "127.0.0.1:9", SEGMENTS)
    assert client.call(address, Release("t-1", True), timeout_s=5) == Released("t-1")
    assert leases.take_finished() == {"req-1"}


def test_unknown_transfer_id_is_refused_after_the_wait(producer):
    _, address, client, _ = producer
    reply = client.call(address, Acquire("nope", "decode", [1]), timeout_s=5)
    assert isinstance(reply, Refused)
    assert "unknown transfer id nope" in reply.reason


def test_a_waiting_acquire_does_not_hold_up_other_calls_to_the_same_producer(producer):
    leases, address, client, holds = producer
    leases.add("req-1", "t-1", [3], nbytes=4096)
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(client.call, address, Acquire("later", "decode", [5]), 5)
        start = time.monotonic()
        fast = pool.submit(client.call, address, Acquire("t-1", "decode", [3]), 5)
        assert isinstance(fast.result(), Granted)
        fast_s = time.monotonic() - start
        holds.send(Hold("req-2", "later", [5]))  # the lease arrives: the first is granted
        assert isinstance(slow.result(), Granted)
        slow_s = time.monotonic() - start
    assert fast_s < 1.0, f"the second acquire waited {fast_s:.2f}s behind the first"
    # Answered when the hold arrived, not at the 1.5 s refusal.
    assert slow_s < 1.0, f"the waiting acquire took {slow_s:.2f}s after its hold was sent"


def test_a_hold_sent_before_the_acquire_is_granted_at_once(producer):
    leases, address, client, holds = producer
    holds.send(Hold("req-9", "t-9", [1, 2]))
    start = time.monotonic()
    assert isinstance(client.call(address, Acquire("t-9", "decode", [1, 2]), 5), Granted)
    assert time.monotonic() - start < 0.5
    assert leases.held_count == 1


def test_no_answer_is_an_error_within_the_timeout():
    client = SideChannelClient()
    try:
        start = time.monotonic()
        with pytest.raises(SideChannelError, match="no answer"):
            client.call(f"127.0.0.1:{free_port()}", Release("t", True), timeout_s=0.5)
        assert time.monotonic() - start < 2
    finally:
        client.close()
