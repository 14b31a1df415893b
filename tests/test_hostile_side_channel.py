"""Hostile peers on the P2P side channel, over real ZeroMQ sockets on loopback: what one bad peer
can no longer do to the others (parked acquires, releases of made-up ids, another prompt's lease,
a replay to a sibling rank), and the consumer's bounded socket cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from harness.servers import free_port
from mooncake_vllm.core.auth import REPLY, REQUEST, AuthError, new_secret, open_frame
from mooncake_vllm.p2p import protocol as wire
from mooncake_vllm.p2p.config import load_settings, resolve
from mooncake_vllm.p2p.leases.client import LeaseService, RankLayout
from mooncake_vllm.p2p.leases.table import LeaseTable
from mooncake_vllm.p2p.local_channels import wake_endpoint
from mooncake_vllm.p2p.side_channel import (
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    abuse_pause_s,
    seal_request,
)

OWNER = b"o" * wire.OWNER_BYTES
DIGEST = wire.prompt_digest([1, 2, 3])
SEGMENTS = [wire.MemSegment(0x1000, 4096, 4096)]


def handoff(transfer_id: str, digest: str = DIGEST) -> wire.Handoff:
    return wire.Handoff(
        transfer_id=transfer_id,
        producer_engine_id="prefill-0",
        producer_tp_size=1,
        remote_block_ids=[3],
        prompt_len=3,
        block_size=16,
        compat_hash="c",
        prompt_digest=digest,
    )


def pending(transfer_id: str, owner: bytes = OWNER, digest: str = DIGEST, wait_ms: int = 600_000):
    """A pending handoff's acquire, as a consumer's worker sends it."""
    return wire.Acquire(
        transfer_id, [], owner, 1, "", wait_ms=wait_ms, layers_ok=True, prompt_digest=digest
    )


class Producer:
    """One producer rank's side channel served in this process, as the lease server serves it
    (``serve_ready``, then ``answer_waiting``), pumped by the test."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.table = LeaseTable(60.0, 1 << 30, 60.0)
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        self.server = SideChannelServer(
            "127.0.0.1", port, self.table, lambda: ("seg", SEGMENTS, []), context=self.ctx
        )
        self.frames = self.dropped = 0

    def pump(self, until: Callable[[], bool], timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, "the producer did not get there in time"
            if self.server.sock.poll(10):
                frames, dropped = self.server.serve_ready()
                self.frames, self.dropped = self.frames + frames, self.dropped + dropped
            self.server.answer_waiting()

    def peer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{self.address}")
        return sock

    def close(self) -> None:
        self.server.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def producer():
    p = Producer()
    yield p
    p.close()


def replies(sock: zmq.Socket) -> list[wire.Frame]:
    out = []
    while sock.poll(0):
        out.append(wire.decode_frame(sock.recv()))
    return out


# ---- finding 5: pending acquires are bounded per peer -----------------------------------------


def test_one_peer_parks_at_most_64_pending_acquires_the_rest_refused_and_counted(producer):
    hostile = producer.peer()
    for i in range(100):  # made-up ids, each to wait ten minutes
        hostile.send(wire.encode_frame(pending(f"{i:032x}")))
    got: list[wire.Frame] = []
    producer.pump(lambda: len(got.__iadd__(replies(hostile))) >= 36)
    assert len(got) == 36 and all(isinstance(r, wire.Refused) for r in got)
    assert "this peer has 64 acquires waiting here already" in got[0].reason
    assert producer.server.guard.dropped["too many pending acquires from one peer"] == 36
    assert producer.dropped == 36  # what makes the lease server rest under abuse


def test_peers_of_many_sockets_cannot_lock_a_real_pending_acquire_out(producer):
    hostile = [producer.peer() for _ in range(17)]  # 17 x 64 is more than the 1024 in all
    for n, sock in enumerate(hostile):
        for i in range(64):
            sock.send(wire.encode_frame(pending(f"{n:016x}{i:016x}")))
    producer.pump(lambda: producer.frames == 17 * 64)
    real, tid = SideChannelClient(), "ab" * 16
    try:
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(real.call, producer.address, pending(tid), 10.0)
            read = producer.frames
            producer.pump(lambda: producer.frames > read)  # it waits for its prefill now
            producer.table.add("req-1", tid, [3], 100, handoff=handoff(tid))
            producer.pump(call.done)
            granted = call.result()
    finally:
        real.close()
    assert isinstance(granted, wire.Granted) and granted.handoff == handoff(tid)
    # Every acquire beyond the 1024 that wait was refused (the new one, or a hostile peer's
    # latest to make room), and counted.
    dropped = producer.server.guard.dropped
    assert (
        dropped["too many pending acquires from one peer"] + dropped["too many pending acquires"]
        == 17 * 64 + 1 - 1024
    )


def test_a_pending_acquire_of_a_made_up_id_is_counted_when_its_wait_runs_out(producer):
    hostile = producer.peer()
    for i in range(3):
        hostile.send(wire.encode_frame(pending(f"{i:032x}", wait_ms=50)))
    got: list[wire.Frame] = []
    producer.pump(lambda: len(got.__iadd__(replies(hostile))) >= 3)
    assert all(isinstance(r, wire.Refused) and "no prefill held" in r.reason for r in got)
    assert producer.server.guard.dropped["pending acquire of an id never held"] == 3


# ---- finding 11: a lease bound to a prompt needs its digest -----------------------------------


def test_a_pending_acquire_without_the_prompt_digest_gets_no_prompts_lease(producer):
    tid = "cd" * 16
    producer.table.add("req-1", tid, [3], 100, handoff=handoff(tid))
    client = SideChannelClient()
    try:
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(client.call, producer.address, pending(tid, digest=""), 5.0)
            producer.pump(call.done)
            refused = call.result()
            # The consumer naming the prompt still gets it.
            call = pool.submit(client.call, producer.address, pending(tid), 5.0)
            producer.pump(call.done)
            assert isinstance(call.result(), wire.Granted)
    finally:
        client.close()
    assert isinstance(refused, wire.Refused)
    assert "names none: send the request's prompt_digest" in refused.reason


# ---- finding 13: releases of made-up ids are counted; the client's sockets are bounded ---------


def test_a_flood_of_releases_of_unknown_ids_is_counted_and_makes_the_server_rest(producer):
    flood = producer.peer()
    for i in range(100):
        flood.send(wire.encode_frame(wire.Release(f"{i:032x}", True, OWNER)))
    producer.pump(lambda: producer.frames == 100)
    assert producer.dropped == 100
    assert producer.server.guard.dropped["release of an unknown transfer id"] == 100
    assert abuse_pause_s(producer.frames, producer.dropped, busy_s=0.001) > 0
    # A release of a lease that ended is not junk: its consumer's pull took longer than the TTL.
    producer.table.add("req-1", "t-1", [3], 100)
    producer.table.acquire("t-1", [3], OWNER)
    producer.table.release("t-1", OWNER)
    flood.send(wire.encode_frame(wire.Release("t-1", True, OWNER)))
    producer.pump(lambda: producer.frames == 101)
    assert producer.dropped == 100


def test_the_client_keeps_its_most_recent_idle_sockets_and_closes_the_others():
    ctx = zmq.Context()
    routers, monitors = [], []
    try:
        for _ in range(6):
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            port = router.bind_to_random_port("tcp://127.0.0.1")
            routers.append((router, f"127.0.0.1:{port}"))
            monitors.append(router.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        client = SideChannelClient(max_idle_sockets=2)
        try:
            for _, address in routers:  # producers that never answer: each call times out
                with pytest.raises(SideChannelError, match="no answer"):
                    client.call(address, wire.Release("t-1", True, OWNER), timeout_s=0.05)
            # The four least recently used sockets are closed: their producers see them go.
            for monitor in monitors[:4]:
                assert monitor.poll(5000), "an evicted socket was not closed"
                assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert not any(m.poll(200) for m in monitors[4:])  # the two kept stay connected
        finally:
            client.close()
    finally:
        for monitor in monitors:
            monitor.close()
        for router, _ in routers:
            router.close()
        ctx.term()


# ---- finding 12: a sealed request names its rank's channel -------------------------------------

KEY = new_secret().encode()


def start_tp2_service(secret_file: str) -> LeaseService:
    """A producer of TP size 2 with the secret; its two side-channel ports follow a free one,
    so another pick is tried when one of them is taken."""
    for _ in range(5):
        extra = {"prefill_url": f"127.0.0.1:{free_port()}", "auth_secret_file": secret_file}
        cfg = resolve(load_settings(extra, env={}), "kv_producer", "prefill", 2)
        try:
            return LeaseService(cfg, wake_endpoint(cfg.host, cfg.base_port))
        except SideChannelError as e:
            if "cannot bind" not in str(e):
                raise
    raise AssertionError("no two free side-channel ports in five picks")


def test_a_sealed_acquire_replayed_to_a_sibling_rank_is_dropped_and_its_reader_served(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(KEY.decode() + "\n")
    service = start_tp2_service(str(secret))
    ctx, client = zmq.Context(), SideChannelClient((KEY,))
    try:
        service.set_layouts({r: RankLayout(f"127.0.0.1:{9 + r}", SEGMENTS, 0) for r in (0, 1)})
        assert service.hold("req-1", "t-1", [3])  # on both ranks (per-head K/V)
        rank0, rank1 = service.addresses
        acquire = wire.Acquire("t-1", [3], OWNER, 1, service.incarnation)
        captured, nonce = seal_request((KEY,), acquire, rank0)
        reader0, replayer = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock, address in ((reader0, rank0), (replayer, rank1)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{address}")
        reader0.send(captured)
        assert reader0.poll(5000)
        granted = wire.decode_frame(open_frame((KEY,), reader0.recv(), REPLY, nonce)[0])
        assert isinstance(granted, wire.Granted) and granted.te_segment == "127.0.0.1:9"
        replayer.send(captured)  # to rank 1, whose replay guard never saw it
        assert not replayer.poll(500)
        # Rank 1's own reader is served: the replay took nothing there.
        other = b"p" * wire.OWNER_BYTES
        got = client.call(rank1, wire.Acquire("t-1", [3], other, 1, service.incarnation), 5)
        assert isinstance(got, wire.Granted) and got.te_segment == "127.0.0.1:10"
        drops: dict[str, int] = {}
        deadline = time.monotonic() + 5
        while not drops.get("bad signature") and time.monotonic() < deadline:
            for reason, n in service.take_dropped_counts().items():
                drops[reason] = drops.get(reason, 0) + n
            time.sleep(0.05)
        assert drops.get("bad signature") == 1
    finally:
        client.close()
        ctx.destroy(linger=0)
        service.close()


def test_a_request_sealed_by_an_older_version_is_refused_naming_it():
    with pytest.raises(AuthError, match="older version"):
        open_frame((KEY,), b"MVA1q" + bytes(8 + 16) + b"body" + bytes(32), REQUEST)
