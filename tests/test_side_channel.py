"""The side channel over real ZeroMQ sockets on loopback, served by a real lease server process
(no vLLM, no transfer engine): what a consumer sees, and what a hostile peer cannot do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from harness.servers import free_port
from mooncake_vllm.core.auth import REPLY, REQUEST, new_secret, open_frame, seal_frame
from mooncake_vllm.p2p import protocol as wire
from mooncake_vllm.p2p.config import load_settings, resolve
from mooncake_vllm.p2p.leases.client import MAX_READERS, LeaseService, RankLayout
from mooncake_vllm.p2p.local_channels import wake_endpoint
from mooncake_vllm.p2p.side_channel import (
    PeerGuard,
    SideChannelClient,
    SideChannelError,
    abuse_pause_s,
    channel_context,
    seal_request,
)

OWNER = b"o" * wire.OWNER_BYTES

SEGMENTS = [wire.MemSegment(0x1000, 4096, 4096)]
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


def acquire(
    service: LeaseService, transfer_id: str, block_ids: list[int], owner: bytes, readers: int = 1
) -> wire.Acquire:
    """An acquire as a consumer sends it, naming the producer start its handoff came from."""
    return wire.Acquire(transfer_id, block_ids, owner, readers, service.incarnation)


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
    reply = client.call(address, acquire(service, "t-1", [3, 4], OWNER), timeout_s=5)
    assert reply == wire.Granted("t-1", "127.0.0.1:9", SEGMENTS, service.incarnation)
    assert service.held_count == 1
    assert client.call(address, wire.Release("t-1", True, OWNER), timeout_s=5) == wire.Released(
        "t-1"
    )
    assert service.take_finished() == {"req-1"}  # reported before the Released reply left
    assert service.take_ended_counts() == {"released": 1}
    assert (service.held_count, service.held_bytes) == (0, 0)


def test_unknown_transfer_id_is_refused_at_once(producer):
    # The producer holds a lease before its handoff exists: an unknown id is never "not yet".
    service, address, client = producer
    start = time.monotonic()
    reply = client.call(address, acquire(service, "nope", [1], OWNER), timeout_s=5)
    assert isinstance(reply, wire.Refused)
    assert "unknown transfer id nope" in reply.reason
    assert time.monotonic() - start < 0.5


def test_concurrent_acquires_to_one_producer_are_answered_independently(producer):
    service, address, client = producer
    for i in range(8):
        service.hold(f"req-{i}", f"t-{i}", [i])
    with ThreadPoolExecutor(8) as pool:
        replies = list(
            pool.map(
                lambda i: client.call(address, acquire(service, f"t-{i}", [i], OWNER), 5), range(8)
            )
        )
    assert all(isinstance(r, wire.Granted) for r in replies)
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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_group_signal_leaves_the_lease_server_serving_its_leases(producer, signum):
    """A signal to vLLM's process group reaches the lease server while its engine core drains:
    the leases it holds are still granted and released; the engine core ends it (close)."""
    service, address, client = producer
    assert service.hold("req-1", "t-1", [3, 4])
    os.kill(service._proc.pid, signum)
    time.sleep(0.3)
    assert service._proc.poll() is None, "the lease server exited on a group signal"
    reply = client.call(address, acquire(service, "t-1", [3, 4], OWNER), timeout_s=5)
    assert isinstance(reply, wire.Granted)
    assert client.call(address, wire.Release("t-1", True, OWNER), timeout_s=5) == wire.Released(
        "t-1"
    )
    assert service.take_finished() == {"req-1"}


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
            client.call(f"127.0.0.1:{free_port()}", wire.Release("t", True, OWNER), timeout_s=0.5)
        assert time.monotonic() - start < 2
    finally:
        client.close()


def test_the_lease_server_imports_neither_vllm_nor_torch():
    # Its start-up is on the engine core's start-up path, and its memory is per producer.
    code = (
        "import sys, mooncake_vllm.p2p.leases.process\n"
        "print(sorted(m for m in ('vllm', 'torch', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- a shared secret, and peers that do not hold it or misuse it -------------------------------

KEY = new_secret().encode()
OTHER_KEY = new_secret().encode()


def start_keyed_service(port: int, tmp_path: Path, **settings) -> LeaseService:
    secret = tmp_path / "secret"
    secret.write_text(KEY.decode() + "\n")
    return start_service(port, auth_secret_file=str(secret), **settings)


@pytest.fixture
def keyed_producer(tmp_path):
    """A producer with the shared secret, and a consumer holding it too."""
    port = free_port()
    service, client = start_keyed_service(port, tmp_path), SideChannelClient((KEY,))
    yield service, f"127.0.0.1:{port}", client
    client.close()
    service.close()


class Drops:
    """What the lease server reports dropping (``LeaseService.take_dropped_counts``, summed)."""

    def __init__(self, service: LeaseService):
        self.service, self.seen = service, Counter()

    def wait_for(self, reason: str, n: int = 1, timeout_s: float = 15.0) -> Counter:
        deadline = time.monotonic() + timeout_s
        while True:
            self.seen.update(self.service.take_dropped_counts())
            if self.seen[reason] >= n:
                return self.seen
            assert time.monotonic() < deadline, f"{reason!r} not reported: {self.seen}"
            time.sleep(0.05)


class RawPeer:
    """A DEALER socket sending bytes of its own choosing: a hostile (or sniffing) peer."""

    def __init__(self, address: str, monitor: bool = False):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Connection events, when asked for: set up before connecting, so none is missed.
        self.events = (
            self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            if monitor
            else None
        )
        self.sock.connect(f"tcp://{address}")

    def next_event(self, timeout_s: float) -> int | None:
        if not self.events.poll(int(1000 * timeout_s)):
            return None
        return recv_monitor_message(self.events)["event"]

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def receive(self, timeout_s: float) -> bytes | None:
        return self.sock.recv() if self.sock.poll(int(1000 * timeout_s)) else None

    def close(self) -> None:
        if self.events is not None:
            self.sock.disable_monitor()
            self.events.close()
        self.sock.close()


def sealed(frame, address: str, keys=(KEY,)) -> tuple[bytes, bytes]:
    """A request for the side channel at ``address`` exactly as a consumer's
    ``SideChannelClient`` sends it: ``(bytes, nonce)``."""
    return seal_request(keys, frame, address)


def reply_to(data: bytes, nonce: bytes, keys=(KEY,)):
    return wire.decode_frame(open_frame(keys, data, REPLY, nonce)[0])


def test_with_the_secret_on_both_sides_a_lease_is_granted_and_released(keyed_producer):
    service, address, client = keyed_producer
    assert service.hold("req-1", "t-1", [3, 4])
    assert client.call(address, acquire(service, "t-1", [3, 4], OWNER), 5) == wire.Granted(
        "t-1", "127.0.0.1:9", SEGMENTS, service.incarnation
    )
    assert client.call(address, wire.Release("t-1", True, OWNER), 5) == wire.Released("t-1")
    assert service.take_finished() == {"req-1"}
    assert client.rejected == 0


@pytest.mark.parametrize("client_keys", [(), (OTHER_KEY,)], ids=["no secret", "another secret"])
def test_a_peer_without_the_secret_gets_no_answer_and_the_drop_is_counted(
    keyed_producer, client_keys
):
    service, address, client = keyed_producer
    assert service.hold("req-1", "t-1", [3])
    stranger = SideChannelClient(client_keys)
    try:
        with pytest.raises(SideChannelError, match="no answer"):
            stranger.call(address, acquire(service, "t-1", [3], OWNER), timeout_s=0.5)
        with pytest.raises(SideChannelError, match="no answer"):
            stranger.call(address, wire.Release("t-1", True, OWNER), timeout_s=0.5)
    finally:
        stranger.close()
    reason = "unauthenticated" if not client_keys else "bad signature"
    # Three frames: the acquire, the release that withdraws it when it got no answer, the release.
    assert Drops(service).wait_for(reason, 3)[reason] == 3
    # Nothing it sent touched the lease: the consumer holding the secret still pulls it.
    assert isinstance(client.call(address, acquire(service, "t-1", [3], OWNER), 5), wire.Granted)
    assert service.take_finished() == set()


def test_a_replayed_acquire_is_dropped_from_any_socket(keyed_producer):
    service, address, _ = keyed_producer
    assert service.hold("req-1", "t-1", [3])
    captured, nonce = sealed(acquire(service, "t-1", [3], OWNER), address)
    peer, other = RawPeer(address), RawPeer(address)
    try:
        peer.send(captured)
        assert isinstance(reply_to(peer.receive(5), nonce), wire.Granted)
        peer.send(captured)  # the same bytes again: dropped before the lease table sees them
        other.send(captured)  # from a socket of its own too
        assert peer.receive(0.5) is None and other.receive(0.1) is None
    finally:
        peer.close()
        other.close()
    assert Drops(service).wait_for("replayed", 2)["replayed"] == 2


@pytest.mark.parametrize("keys", [(), (KEY,)], ids=["no secret", "the forger holds the secret"])
def test_a_release_by_a_peer_that_did_not_acquire_does_not_end_the_lease(tmp_path, keys):
    # The forger knows the transfer id (it saw the handoff), and may even hold the secret (a
    # fellow consumer); it never holds the owner token of the pull that acquired the lease.
    port = free_port()
    service = start_keyed_service(port, tmp_path) if keys else start_service(port)
    address, client = f"127.0.0.1:{port}", SideChannelClient(keys)
    forger = RawPeer(address)
    try:
        assert service.hold("req-1", "t-1", [3])
        assert isinstance(
            client.call(address, acquire(service, "t-1", [3], OWNER), 5), wire.Granted
        )
        for owner in (b"x" * wire.OWNER_BYTES, b"", OWNER[:-1]):
            for ok in (True, False):
                forger.send(sealed(wire.Release("t-1", ok, owner), address, keys)[0])
        assert forger.receive(0.5) is None  # no answer: it learns nothing
        drops = Drops(service).wait_for("release by a non-owner", 6)
        assert drops["release by a non-owner"] == 6
        assert (service.held_count, service.take_finished()) == (1, set())
        # The real owner still releases it, and its pull counts as a success.
        assert client.call(address, wire.Release("t-1", True, OWNER), 5) == wire.Released("t-1")
        assert service.take_finished() == {"req-1"}
        assert service.take_ended_counts() == {"released": 1}
    finally:
        forger.close()
        client.close()
        service.close()


@pytest.mark.parametrize(
    "block_ids", [[], [4], [3], [3, 4, 5], [4, 3]], ids=["empty", "other", "fewer", "more", "order"]
)
def test_an_acquire_that_does_not_name_exactly_the_holds_blocks_is_refused(
    keyed_producer, block_ids
):
    service, address, client = keyed_producer
    assert service.hold("req-1", "t-1", [3, 4])
    reply = client.call(address, acquire(service, "t-1", block_ids, OWNER), 5)
    assert reply == wire.Refused("t-1", "transfer t-1: the blocks are not the lease's")
    assert isinstance(client.call(address, acquire(service, "t-1", [3, 4], OWNER), 5), wire.Granted)


def test_readers_beyond_the_hold_are_refused(keyed_producer):
    # A lease is read by at most MAX_READERS consumer ranks (a TP size): no peer can pin it for
    # more, and the first acquire fixes the count.
    service, address, client = keyed_producer
    assert service.hold("req-1", "t-1", [3])
    reply = client.call(address, acquire(service, "t-1", [3], OWNER, readers=MAX_READERS + 1), 5)
    assert reply == wire.Refused("t-1", f"readers={MAX_READERS + 1} outside 1..{MAX_READERS}")
    assert isinstance(client.call(address, acquire(service, "t-1", [3], OWNER, 2), 5), wire.Granted)
    other = b"p" * wire.OWNER_BYTES
    reply = client.call(address, acquire(service, "t-1", [3], other, readers=3), 5)
    assert reply == wire.Refused("t-1", "readers=3, the lease was acquired for 2")


def test_an_oversized_frame_disconnects_its_peer_and_later_peers_are_served(tmp_path):
    port = free_port()
    service = start_keyed_service(port, tmp_path, side_channel_max_frame_bytes=4096)
    address, client = f"127.0.0.1:{port}", SideChannelClient((KEY,))
    big = RawPeer(address, monitor=True)
    try:
        assert service.hold("req-1", "t-1", [3])
        assert big.next_event(5) == zmq.EVENT_CONNECTED
        frame, _ = sealed(acquire(service, "t-1", list(range(2000)), OWNER), address)
        assert len(frame) > 4096
        big.send(frame)
        assert big.next_event(5) == zmq.EVENT_DISCONNECTED, "the oversized frame was read"
        assert big.receive(0.2) is None
        # A fresh socket, and a normal frame: served, and the lease was untouched.
        assert isinstance(
            client.call(address, acquire(service, "t-1", [3], OWNER), 5), wire.Granted
        )
        assert client.call(address, wire.Release("t-1", True, OWNER), 5) == wire.Released("t-1")
    finally:
        big.close()
        client.close()
        service.close()


def test_a_flooding_peer_is_rate_limited_and_other_peers_are_still_served(tmp_path):
    port = free_port()
    service = start_keyed_service(port, tmp_path, side_channel_peer_rate=5.0)  # burst of 10
    address, client = f"127.0.0.1:{port}", SideChannelClient((KEY,))
    flood = RawPeer(address)
    try:
        assert service.hold("req-1", "t-1", [3])
        for i in range(40):
            flood.send(sealed(acquire(service, f"nope-{i}", [1], OWNER), address)[0])
        answered = 0
        while flood.receive(0.3) is not None:
            answered += 1
        assert 10 <= answered < 40
        assert isinstance(
            client.call(address, acquire(service, "t-1", [3], OWNER), 5), wire.Granted
        )
        assert Drops(service).wait_for("rate limited")["rate limited"] == 40 - answered
    finally:
        flood.close()
        client.close()
        service.close()


# ---- the consumer's client: only replies sealed for its own request count ---------------------


def test_the_client_skips_replies_not_sealed_for_its_request():
    """A fake producer answers with an unsealed reply, a reply sealed with another secret and one
    sealed for another request, then the true one: the client returns the true one."""
    port = free_port()
    producer = zmq.Context.instance().socket(zmq.ROUTER)
    producer.setsockopt(zmq.LINGER, 0)
    producer.bind(f"tcp://127.0.0.1:{port}")
    client = SideChannelClient((KEY,))

    def answer():
        identity, request = producer.recv_multipart()
        body, _, nonce = open_frame((KEY,), request, REQUEST, channel_context(port))
        assert wire.decode_frame(body) == wire.Acquire("t-1", [3], OWNER)
        grant = wire.encode_frame(wire.Granted("t-1", "forged:1", []))
        _, other_nonce = sealed(wire.Acquire("t-1", [3], OWNER), f"127.0.0.1:{port}")
        for data in (
            grant,
            seal_frame((OTHER_KEY,), grant, REPLY, nonce)[0],
            seal_frame((KEY,), grant, REPLY, other_nonce)[0],  # an old reply, replayed
            seal_frame((KEY,), wire.encode_frame(wire.Granted("t-1", "real:1", [])), REPLY, nonce)[
                0
            ],
        ):
            producer.send_multipart([identity, data])

    try:
        with ThreadPoolExecutor(1) as pool:
            answered = pool.submit(answer)
            reply = client.call(f"127.0.0.1:{port}", wire.Acquire("t-1", [3], OWNER), 5)
            answered.result()
        assert reply == wire.Granted("t-1", "real:1", [])
        assert client.rejected == 3
    finally:
        client.close()
        producer.close()


# ---- PeerGuard: per-peer rate, the peer cap, the counts (an injected clock) ---------------------


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_a_peer_gets_a_burst_of_two_seconds_then_the_rate():
    clock = FakeClock()
    guard = PeerGuard(rate_per_s=10.0, max_peers=4, clock=clock)
    assert [guard.admit(b"a") for _ in range(21)] == [True] * 20 + [False]
    clock.now_s += 0.1  # one frame's worth
    assert [guard.admit(b"a") for _ in range(2)] == [True, False]
    clock.now_s += 0.5
    assert sum(guard.admit(b"a") for _ in range(10)) == 5
    assert guard.take_dropped() == {"rate limited": 1 + 1 + 5}


def test_the_burst_does_not_grow_while_a_peer_is_quiet():
    clock = FakeClock()
    guard = PeerGuard(rate_per_s=10.0, max_peers=4, clock=clock)
    guard.admit(b"a")
    clock.now_s += 3600.0
    assert sum(guard.admit(b"a") for _ in range(100)) == 20


def test_peers_are_limited_each_on_their_own():
    guard = PeerGuard(rate_per_s=1.0, max_peers=4, clock=FakeClock())
    assert [guard.admit(b"a") for _ in range(3)] == [True, True, False]
    assert [guard.admit(b"b") for _ in range(3)] == [True, True, False]


def test_the_peer_cap_evicts_the_least_recently_heard_and_never_locks_out_a_new_peer():
    clock = FakeClock()
    guard = PeerGuard(rate_per_s=1.0, max_peers=2, clock=clock)
    for _ in range(3):
        guard.admit(b"consumer")  # rate limited from the third on
    guard.admit(b"other")
    clock.now_s += 0.5
    guard.admit(b"consumer")  # heard last: "other" is now the least recent
    assert guard.admit(b"new-0")
    assert list(guard._peers) == [b"consumer", b"new-0"]
    # A flood of new identities (one per socket): each is admitted, the cap holds ...
    assert all(guard.admit(b"new-%d" % i) for i in range(1, 100))
    assert len(guard._peers) == 2
    # ... and evicted peers come back with a fresh bucket, not locked out.
    assert guard.admit(b"consumer") and guard.admit(b"other")
    dropped = guard.dropped
    assert dropped["peers evicted"] == 1 + 99 + 2
    assert guard.take_dropped() == {"rate limited": 2}  # evictions are not dropped frames


def test_idle_peers_are_forgotten():
    clock = FakeClock()
    guard = PeerGuard(rate_per_s=1.0, max_peers=2, clock=clock)
    guard.admit(b"old")
    clock.now_s += 30.0
    guard.admit(b"recent")
    clock.now_s += 31.0  # "old" silent for 61 s, "recent" for 31 s
    guard.forget_idle()
    assert list(guard._peers) == [b"recent"]
    guard.admit(b"new")  # room for it: nobody evicted
    assert guard.dropped["peers evicted"] == 0


def test_take_dropped_returns_the_counts_once():
    guard = PeerGuard(rate_per_s=1.0, max_peers=1, clock=FakeClock())
    guard.drop("bad signature")
    guard.drop("bad signature")
    guard.drop("replayed")
    guard.admit(b"a")
    guard.admit(b"b")  # evicts "a": not a dropped frame
    assert guard.take_dropped() == {"bad signature": 2, "replayed": 1}
    assert guard.take_dropped() == {}


def test_a_rate_below_one_frame_per_two_seconds_still_admits_frames():
    # Two seconds' worth of 0.25 frames/s is half a frame: the burst is never below one.
    clock = FakeClock()
    guard = PeerGuard(rate_per_s=0.25, max_peers=4, clock=clock)
    assert [guard.admit(b"a") for _ in range(2)] == [True, False]
    clock.now_s += 3.9
    assert not guard.admit(b"a")
    clock.now_s += 4.0
    assert guard.admit(b"a")


# ---- the lease server's duty cycle under a flood -----------------------------------------------


@pytest.mark.parametrize(
    ("frames", "dropped", "busy_s", "pause_s"),
    [
        (0, 0, 0.0, 0.0),  # idle
        (10, 10, 0.001, 0.0),  # a few bad frames: not a flood
        (256, 100, 0.005, 0.0),  # a busy batch of mostly real frames is never slowed
        (256, 200, 0.002, 0.006),  # mostly junk: three times the batch's time
        (256, 256, 0.05, 0.01),  # capped: a real frame waits at most one pause
    ],
)
def test_the_lease_server_rests_only_after_batches_of_junk(frames, dropped, busy_s, pause_s):
    assert abuse_pause_s(frames, dropped, busy_s) == pytest.approx(pause_s)


def test_serve_ready_reads_a_bounded_batch_and_counts_its_drops():
    from mooncake_vllm.p2p.leases.table import LeaseTable
    from mooncake_vllm.p2p.side_channel import SideChannelServer

    ctx = zmq.Context()
    port = free_port()
    server = SideChannelServer(
        "127.0.0.1", port, LeaseTable(10.0, 1 << 30, 1.0), lambda: ("seg", [], []), context=ctx
    )
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        peer.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(50):
            peer.send(b"\x00junk")
        deadline = time.monotonic() + 5
        while not server.sock.poll(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # all 50 queued
        assert server.serve_ready(max_frames=20) == (20, 20)
        assert server.serve_ready(max_frames=100) == (30, 30)
        assert server.serve_ready() == (0, 0)
    finally:
        peer.close()
        server.close()
        ctx.term()


def test_an_acquire_that_timed_out_is_withdrawn_behind_it():
    """Across a cut link an acquire reaches the producer after the consumer gave up: the release
    that follows it on the same connection ends the grant at once, instead of the producer's
    pull hold (tests/test_netns_e2e.py). A pending acquire is left to the producer's wait."""
    port = free_port()
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    client = SideChannelClient()
    try:
        for frame, withdrawn in [
            (wire.Acquire("t-late", [1, 2], OWNER, 1, "inc"), True),
            (wire.Acquire("t-pending", [], OWNER, 1, "", wait_ms=100), False),
        ]:
            with pytest.raises(SideChannelError, match="no answer"):
                client.call(f"127.0.0.1:{port}", frame, timeout_s=0.3)
            got = []
            while router.poll(300):
                got.append(wire.decode_frame(router.recv_multipart()[1]))
            expected = [frame]
            if withdrawn:
                expected.append(wire.Release(frame.transfer_id, ok=False, owner=OWNER))
            assert got == expected
    finally:
        client.close()
        router.close()
