"""The worker half in-process: a pull against a fake transfer engine and a fake side channel, its
outcome as vLLM collects it, and when its blocks are reported settled (no vLLM, no servers)."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
import zmq

from harness.servers import free_port
from mooncake_vllm.core.auth import new_secret, seal_record
from mooncake_vllm.core.registry import EngineRecord, encode_record, registry_key
from mooncake_vllm.p2p import protocol, upstream
from mooncake_vllm.p2p.bootstrap import BootstrapService
from mooncake_vllm.p2p.config import load_settings, resolve
from mooncake_vllm.p2p.leases.process import LayerDone
from mooncake_vllm.p2p.local_channels import layers_endpoint
from mooncake_vllm.p2p.side_channel import CallCancelled
from mooncake_vllm.p2p.step_metadata import LoadSpec, MooncakeConnectorMetadata
from mooncake_vllm.p2p.worker import WorkerHalf
from mooncake_vllm.transfer.engine import TransferAgent

BLOCK = 64
REMOTE = protocol.MemSegment(base_addr=10_000, block_stride=BLOCK, block_len=BLOCK)
LOCAL = protocol.MemSegment(base_addr=20_000, block_stride=BLOCK, block_len=BLOCK)


class GatedEngine:
    """Reads of the KV blocks stay pending until ``done`` is set, then complete. Other reads (the
    first-contact warm-up, which reads the segment's first bytes) complete at once."""

    def __init__(self):
        self.done = threading.Event()
        self.fail = False  # KV reads end failed (-1), as when the producer dropped the connection
        self.next_bid = 1
        self.submitted: list[int] = []
        self._src: dict[int, int] = {}

    def batch_transfer_async_read(self, peer, dsts, srcs, lens):
        bid, self.next_bid = self.next_bid, self.next_bid + 1
        self.submitted.append(srcs[0])
        self._src[bid] = srcs[0]
        return bid

    def transfer_check_status(self, bid):
        if self._src[bid] == REMOTE.base_addr:
            return 1
        if self.fail:
            return -1
        return 1 if self.done.is_set() else 0

    def register_memory(self, addr, length, location):
        return 0

    def unregister_memory(self, addr):
        return 0


class FakeSideChannel:
    def __init__(self, reply=None):
        self.reply = reply
        self.frames: list[object] = []
        self.addresses: list[str] = []
        self.rejected = 0  # replies that did not verify (SideChannelClient)

    def take_rejected(self) -> int:
        out, self.rejected = self.rejected, 0
        return out

    def call(self, address, frame, timeout_s, cancelled=None):
        self.frames.append(frame)
        self.addresses.append(address)
        if isinstance(frame, protocol.Release):
            return protocol.Released(frame.transfer_id)
        assert isinstance(frame, protocol.Acquire)
        return self.reply or protocol.Granted(frame.transfer_id, "producer:1", [REMOTE])

    def close(self):
        pass


def make_worker(engine, side_channel, load_timeout_s: float = 0.6, **settings) -> WorkerHalf:
    settings = load_settings(
        {"decode_url": "127.0.0.1:17000", "load_timeout_s": load_timeout_s, **settings}, env={}
    )
    worker = WorkerHalf(resolve(settings, "kv_consumer", "consumer", 1), 0, "hash", 8)
    # What register_kv_caches sets up around a real engine and real KV tensors.
    worker._puller.reader.attach(TransferAgent.wrapping(engine), [LOCAL])
    worker._puller._client = side_channel
    return worker


def load(req_id: str = "req-1", blocks: int = 2) -> MooncakeConnectorMetadata:
    handoff = protocol.Handoff(
        transfer_id=f"t-{req_id}",
        producer_engine_id="producer",
        side_channel_host="127.0.0.1",
        side_channel_ports=[16000],
        producer_tp_size=1,
        remote_block_ids=list(range(1, 1 + blocks)),
        prompt_len=blocks * 16,
        block_size=16,
        compat_hash="hash",
    )
    spec = LoadSpec(req_id, handoff, list(range(1, 1 + blocks)), list(range(3, 3 + blocks)))
    return MooncakeConnectorMetadata(loads=[spec])


def collect_until(worker: WorkerHalf, check, timeout_s: float = 5.0):
    """Calls vLLM's per-step hooks until ``check(results, meta)`` holds; returns what it saw."""
    deadline = time.monotonic() + timeout_s
    seen_recving, seen_failed, settled = set(), set(), []
    while True:
        results = worker.get_transfer_results()
        seen_recving |= results.finished_recving
        seen_failed |= results.failed_recving
        if (meta := worker.build_worker_meta()) is not None:
            settled += meta.settled
        if check(seen_recving, seen_failed, settled):
            return seen_recving, seen_failed, settled
        assert time.monotonic() < deadline, (seen_recving, seen_failed, settled)
        time.sleep(0.01)


@pytest.fixture
def engine():
    return GatedEngine()


class WakeRecorder:
    """Stands in for the scheduler's wake-up channel: notes whether the pulls were done then."""

    def __init__(self, worker: WorkerHalf):
        self.worker, self.seen = worker, []

    def wake(self):
        self.seen.append(self.worker._puller.running() == 0)

    def close(self):
        pass


def test_a_pull_that_ends_is_reported_once_and_settled(engine):
    engine.done.set()
    channel = FakeSideChannel()
    worker = make_worker(engine, channel)
    worker._wake = wake = WakeRecorder(worker)
    worker.start_load_kv(load())
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    # The scheduler is woken only once the outcome can be collected (else it could rest on).
    assert wake.seen == [True]
    assert (recving, failed, settled) == ({"req-1"}, set(), ["req-1"])
    # The first contact's warm-up, then both blocks in one entry (adjacent on both sides).
    assert engine.submitted == [REMOTE.base_addr, REMOTE.base_addr + BLOCK]
    assert worker.get_stats().data["pulls"] == 1
    worker.shutdown()
    acquire, release = channel.frames
    assert acquire == protocol.Acquire("t-req-1", [1, 2], acquire.owner, readers=1, layers_ok=True)
    assert len(acquire.owner) == protocol.OWNER_BYTES
    # Only the owner can release it.
    assert release == protocol.Release("t-req-1", True, acquire.owner)


def test_a_pull_past_its_deadline_is_failed_at_once_and_settled_only_when_its_entries_end(
    engine, caplog
):
    worker = make_worker(engine, FakeSideChannel(), load_timeout_s=0.6)
    started = time.monotonic()
    worker.start_load_kv(load())
    recving, failed, settled = collect_until(worker, lambda r, f, s: r)
    waited = time.monotonic() - started
    assert (recving, failed, settled) == ({"req-1"}, {"req-1"}, [])
    assert waited < 0.6 + 0.5, f"reported after {waited:.2f}s"
    assert "still in the read" in caplog.text
    time.sleep(0.2)
    assert worker.build_worker_meta() is None  # entries still in flight: blocks stay pinned
    engine.done.set()  # the late entries end (here: they complete)
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    assert (recving, failed, settled) == (set(), set(), ["req-1"])  # not reported a second time
    assert worker.get_stats().data["pull_failures"] == 1
    worker.shutdown()


def test_failed_reads_fail_the_pull_and_settle_it_and_the_lease_is_released_as_failed(engine):
    engine.fail = True
    channel = FakeSideChannel()
    worker = make_worker(engine, channel, load_timeout_s=5.0)
    worker.start_load_kv(load())
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    assert (recving, failed, settled) == ({"req-1"}, {"req-1"}, ["req-1"])
    worker.shutdown()
    assert isinstance(channel.frames[-1], protocol.Release) and not channel.frames[-1].ok


def test_a_refused_acquire_is_a_failure_and_settles_at_once(engine):
    worker = make_worker(
        engine, FakeSideChannel(protocol.Refused("t-req-1", "unknown transfer id"))
    )
    worker.start_load_kv(load())
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    assert (recving, failed, settled) == ({"req-1"}, {"req-1"}, ["req-1"])
    assert engine.submitted == []
    assert worker.get_stats().data["refused"] == 1
    worker.shutdown()


def test_a_load_vllm_does_not_wait_for_only_releases_the_lease(engine):
    channel = FakeSideChannel()
    worker = make_worker(engine, channel)
    meta = load()
    meta.loads[0] = LoadSpec("req-1", meta.loads[0].handoff, [], [])
    worker.start_load_kv(meta)
    recving, failed, _ = collect_until(worker, lambda r, f, s: s)
    assert (recving, failed) == (set(), set())
    worker.shutdown()
    # Only an owner may release a lease (before owner tokens: a bare Release), so the worker
    # acquires the whole hold, then releases it at once; nothing is read.
    acquire, release = channel.frames
    assert acquire == protocol.Acquire("t-req-1", [1, 2], acquire.owner, layers_ok=True)
    assert release == protocol.Release("t-req-1", True, acquire.owner)
    assert engine.submitted == []


def test_a_rejected_handoff_fails_without_reading_and_frees_the_producers_lease(engine):
    # E.g. another model's KV (compat hash): nothing is read, the lease is released as failed.
    channel = FakeSideChannel()
    worker = make_worker(engine, channel)
    meta = load()
    spec = meta.loads[0]
    meta.loads[0] = LoadSpec("req-1", spec.handoff, spec.remote_block_ids, spec.local_block_ids,
                             error="compat hash mismatch")  # fmt: skip
    worker.start_load_kv(meta)
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    worker.shutdown()  # waits for the release
    assert (recving, failed, settled) == ({"req-1"}, {"req-1"}, ["req-1"])
    assert engine.submitted == []
    acquire, release = channel.frames  # acquired only to be released, as failed
    assert acquire == protocol.Acquire("t-req-1", [1, 2], acquire.owner, layers_ok=True)
    assert release == protocol.Release("t-req-1", False, acquire.owner)


# ---- owner tokens, trusted producers, signed registry records ---------------------------------


def test_a_partial_local_hit_acquires_the_whole_hold_and_reads_only_the_missing_blocks(engine):
    engine.done.set()
    channel = FakeSideChannel()
    worker = make_worker(engine, channel)
    meta = load(blocks=3)
    spec = meta.loads[0]
    # Blocks 1 and 2 (tokens 0..31) are cached here.
    meta.loads[0] = LoadSpec("req-1", spec.handoff, [1, 2, 3], [5], first_token=32)
    worker.start_load_kv(meta)
    collect_until(worker, lambda r, f, s: s)
    worker.shutdown()
    acquire, release = channel.frames
    assert acquire.remote_block_ids == [1, 2, 3]  # the producer's lease is the whole prompt
    assert engine.submitted == [REMOTE.base_addr, REMOTE.base_addr + 3 * BLOCK]  # block 3 only
    assert release == protocol.Release("t-req-1", True, acquire.owner)


def test_every_pull_has_its_own_owner_token(engine):
    engine.done.set()
    channel = FakeSideChannel()
    worker = make_worker(engine, channel)
    worker.start_load_kv(load("req-1"))
    worker.start_load_kv(load("req-2"))
    collect_until(worker, lambda r, f, s: len(s) == 2)
    worker.shutdown()
    owners = {f.transfer_id: f.owner for f in channel.frames if isinstance(f, protocol.Acquire)}
    assert len(set(owners.values())) == 2
    for release in (f for f in channel.frames if isinstance(f, protocol.Release)):
        assert release.owner == owners[release.transfer_id]


def test_a_lease_whose_acquire_is_refused_is_not_released(engine):
    # Nothing to give back: the producer ended the lease already (or never had it).
    channel = FakeSideChannel(protocol.Refused("t-req-1", "transfer t-req-1 already expired"))
    worker = make_worker(engine, channel)
    meta = load()
    meta.loads[0] = LoadSpec("req-1", meta.loads[0].handoff, [], [])
    worker.start_load_kv(meta)
    collect_until(worker, lambda r, f, s: s)
    worker.shutdown()
    assert [type(f) for f in channel.frames] == [protocol.Acquire]


@pytest.mark.parametrize(
    ("trusted", "te_segment", "ok"),
    [
        (["127.0.0.1", "10.0.0.0/8"], "10.0.0.5:17001", True),
        (["127.0.0.1"], "10.0.0.5:17001", False),  # the handoff's host is trusted, not this one
        (["127.0.0.1", "producer"], "producer:1", True),
        (["127.0.0.1"], "producer:1", False),
    ],
)
def test_a_grant_pointing_reads_at_an_untrusted_host_fails_the_pull_unread(
    engine, caplog, trusted, te_segment, ok
):
    engine.done.set()
    channel = FakeSideChannel(protocol.Granted("t-req-1", te_segment, [REMOTE]))
    worker = make_worker(engine, channel, trusted_producers=trusted)
    worker.start_load_kv(load())
    _, failed, _ = collect_until(worker, lambda r, f, s: s)
    worker.shutdown()
    assert failed == (set() if ok else {"req-1"})
    acquire, release = channel.frames
    assert release == protocol.Release("t-req-1", ok, acquire.owner)  # released either way
    if not ok:
        assert engine.submitted == []  # not even the warm-up read
        host = te_segment.rpartition(":")[0]
        assert f"transfer-engine segment {host!r} is not in trusted_producers" in caplog.text


KEY, NEW_KEY, OTHER_KEY = new_secret(), new_secret(), new_secret()


class FakeBridge:
    """The metadata store as the worker reads it: ``registry_key`` → stored bytes."""

    def __init__(self, records: dict[str, bytes]):
        self.records = records

    def lookup(self, key: str) -> bytes | None:
        return self.records.get(key)

    def close(self):
        pass


def registry_record(side_channel: str = "10.0.0.1:16001") -> bytes:
    return encode_record(
        EngineRecord(
            engine_id="producer",
            role="kv_producer",
            tp_rank=0,
            tp_size=1,
            side_channel=side_channel,
            te_segment="10.0.0.1:16000",
            compat_hash="hash",
        )
    )


@pytest.mark.parametrize(
    ("stored", "trusted", "error"),
    [
        (seal_record((KEY.encode(),), registry_record()), None, None),
        (seal_record((NEW_KEY.encode(), KEY.encode()), registry_record()), None, None),
        (registry_record(), None, "registry record of 'producer': unsigned record"),
        (
            seal_record((OTHER_KEY.encode(),), registry_record()),
            None,
            "registry record of 'producer': bad record signature",
        ),
        (
            seal_record((KEY.encode(),), registry_record()).replace(b"10.0.0.1:1", b"10.6.6.6:1"),
            None,
            "bad record signature",
        ),
        (
            seal_record((KEY.encode(),), registry_record("10.6.6.6:16001")),
            ["10.0.0.0/24"],
            "registry side channel '10.6.6.6' is not in trusted_producers",
        ),
    ],
    ids=["signed", "rotated", "unsigned", "other key", "tampered", "untrusted host"],
)
def test_a_producer_looked_up_in_the_registry_must_be_signed_and_trusted(
    engine, caplog, monkeypatch, stored, trusted, error
):
    monkeypatch.setenv("MV_TEST_SECRET", f"{KEY}\n{NEW_KEY}")  # a rotation under way
    engine.done.set()
    channel = FakeSideChannel(protocol.Granted("t-req-1", "10.0.0.1:16000", [REMOTE]))
    settings = {"auth_secret_env": "MV_TEST_SECRET"}
    if trusted is not None:
        settings["trusted_producers"] = trusted
    worker = make_worker(engine, channel, **settings)
    worker._puller._bridge = FakeBridge({registry_key("producer", 0): stored})
    meta = load()
    spec = meta.loads[0]
    # No side channel in the handoff: the worker looks the producer up by its engine id.
    unnamed = msgspec.structs.replace(spec.handoff, side_channel_host="", side_channel_ports=[])
    meta.loads[0] = LoadSpec("req-1", unnamed, spec.remote_block_ids, spec.local_block_ids)
    worker.start_load_kv(meta)
    _, failed, _ = collect_until(worker, lambda r, f, s: s)
    worker.shutdown()
    if error is None:
        assert failed == set() and channel.addresses[0] == "10.0.0.1:16001"
    else:
        assert failed == {"req-1"} and channel.frames == []  # nobody was contacted
        assert error in caplog.text


def test_replies_the_client_dropped_are_counted_in_the_stats(engine):
    channel = FakeSideChannel()
    worker = make_worker(engine, channel)
    channel.rejected = 2
    assert worker.get_stats().data["rejected_frames"] == 2
    assert worker.get_stats() is None  # counted once
    assert channel.rejected == 0


# ---- other layouts: TP sizes and block sizes ------------------------------------------------

UNIT = 8  # bytes of one (head, token)


def _cpu_segment(base: int, heads: int, block_size: int) -> protocol.MemSegment:
    """One layer in vLLM's CPU layout, [blocks, heads, block_size, unit], in head slabs."""
    slab = block_size * UNIT
    return protocol.MemSegment(base, heads * slab, heads * slab, heads, block_size, slab, 0, slab)


class PerRankSideChannel(FakeSideChannel):
    """Grants each producer rank's lease (by side-channel port) with that rank's segment."""

    def __init__(self, segments: dict[int, protocol.MemSegment]):
        super().__init__()
        self.segments = segments

    def call(self, address, frame, timeout_s, cancelled=None):
        if isinstance(frame, protocol.Acquire):
            self.frames.append(frame)
            self.addresses.append(address)
            port = int(address.rpartition(":")[2])
            return protocol.Granted(frame.transfer_id, f"p{port}:1", [self.segments[port]])
        return super().call(address, frame, timeout_s, cancelled)


def _layout_worker(engine, channel, tp_size: int, rank: int, block_size: int) -> WorkerHalf:
    settings = load_settings({"decode_url": "127.0.0.1:17000"}, env={})
    cfg = resolve(settings, "kv_consumer", "consumer", tp_size)
    worker = WorkerHalf(cfg, rank, "hash", 8, kv_heads=4, block_size=block_size)
    segment = _cpu_segment(20_000, 4 // tp_size, block_size)
    worker._puller.reader.attach(TransferAgent.wrapping(engine), [segment])
    worker._puller._client = channel
    return worker


def _layout_load(producer_tp: int, block_size: int, prompt_len: int, local: list[int]):
    blocks = -(-prompt_len // block_size)
    handoff = protocol.Handoff(
        transfer_id="t-req-1",
        producer_engine_id="producer",
        side_channel_host="127.0.0.1",
        side_channel_ports=[16000 + 2 * r for r in range(producer_tp)],
        producer_tp_size=producer_tp,
        remote_block_ids=list(range(blocks)),
        prompt_len=prompt_len,
        block_size=block_size,
        compat_hash="hash",
    )
    spec = LoadSpec("req-1", handoff, list(range(blocks)), local)
    return MooncakeConnectorMetadata(loads=[spec])


def test_a_tp1_consumer_reads_half_the_heads_from_each_rank_of_a_tp2_producer(engine):
    engine.done.set()
    # Producer rank r: heads 2r, 2r+1, 16-token blocks at 100_000 * (r + 1).
    segments = {16000 + 2 * r: _cpu_segment(100_000 * (r + 1), 2, 16) for r in range(2)}
    channel = PerRankSideChannel(segments)
    worker = _layout_worker(engine, channel, tp_size=1, rank=0, block_size=16)
    worker.start_load_kv(_layout_load(2, 16, 40, local=[5, 6, 7]))  # 40 tokens: 3 blocks
    recving, failed, _ = collect_until(worker, lambda r, f, s: s)
    stats = worker.get_stats()
    worker.shutdown()
    assert (recving, failed) == ({"req-1"}, set())
    acquires = [f for f in channel.frames if isinstance(f, protocol.Acquire)]
    releases = [f for f in channel.frames if isinstance(f, protocol.Release)]
    # Acquired from both producer ranks, then released at both.
    assert channel.addresses == ["127.0.0.1:16000", "127.0.0.1:16002"] * 2
    assert [a.readers for a in acquires] == [1, 1]  # nobody else reads either rank
    assert sorted(r.owner for r in releases) == sorted(a.owner for a in acquires)
    # Every head of every block once: 3 blocks x 4 heads x 16 tokens x 8 bytes.
    assert stats.data["bytes"] == 3 * 4 * 16 * UNIT


@pytest.mark.parametrize("rank", [0, 1])
def test_both_ranks_of_a_tp2_consumer_share_the_lease_of_a_tp1_producer(engine, rank):
    engine.done.set()
    channel = PerRankSideChannel({16000: _cpu_segment(100_000, 4, 16)})
    worker = _layout_worker(engine, channel, tp_size=2, rank=rank, block_size=16)
    worker.start_load_kv(_layout_load(1, 16, 40, local=[5, 6, 7]))
    recving, failed, _ = collect_until(worker, lambda r, f, s: s)
    stats = worker.get_stats()
    worker.shutdown()
    assert (recving, failed) == ({"req-1"}, set())
    (acquire,) = [f for f in channel.frames if isinstance(f, protocol.Acquire)]
    assert acquire.readers == 2  # the producer's lease ends with the second rank's release
    assert stats.data["bytes"] == 3 * 2 * 16 * UNIT  # this rank's two heads only


# ---- pending handoffs (the proxy's --dispatch concurrent) --------------------------------------


class PendingSideChannel(FakeSideChannel):
    """A producer whose prefill finishes when ``finish`` is set: a pending acquire waits for it
    (or for its ``cancelled`` event) and is granted ``handoff``."""

    def __init__(self, handoff: protocol.Handoff):
        super().__init__()
        self.handoff, self.finish = handoff, threading.Event()

    def call(self, address, frame, timeout_s, cancelled=None):
        if isinstance(frame, protocol.Acquire) and frame.wait_ms:
            self.frames.append(frame)
            deadline = time.monotonic() + timeout_s
            while not self.finish.wait(0.01):
                if cancelled is not None and cancelled.is_set():
                    raise CallCancelled("cancelled")
                assert time.monotonic() < deadline
            return protocol.Granted(frame.transfer_id, "producer:1", [REMOTE], "inc", self.handoff)
        return super().call(address, frame, timeout_s, cancelled)


TID = "ab" * 16


def pending_load(req_id: str = "req-1", blocks: int = 2) -> MooncakeConnectorMetadata:
    pending = protocol.PendingHandoff(
        transfer_id=TID,
        producer_engine_id="producer",
        side_channel_host="127.0.0.1",
        side_channel_ports=[16000],
        producer_tp_size=1,
    )
    checks = protocol.HandoffChecks(
        prompt_len=blocks * 16, compat_hash="hash", kv_heads=1, tp_size=1, block_size=16
    )
    spec = LoadSpec(req_id, pending, [], list(range(3, 3 + blocks)), checks=checks)
    return MooncakeConnectorMetadata(loads=[spec])


def granted_handoff(blocks: int = 2, **change) -> protocol.Handoff:
    fields = dict(
        transfer_id=TID, producer_engine_id="producer", side_channel_host="127.0.0.1",
        side_channel_ports=[16000], producer_tp_size=1, remote_block_ids=list(range(1, 1 + blocks)),
        prompt_len=blocks * 16, block_size=16, compat_hash="hash", producer_incarnation="inc",
    )  # fmt: skip
    return protocol.Handoff(**{**fields, **change})


def test_a_pending_pull_waits_for_the_prefill_then_reads_the_granted_blocks(engine):
    engine.done.set()
    channel = PendingSideChannel(granted_handoff())
    worker = make_worker(engine, channel, load_timeout_s=5.0)
    worker.start_load_kv(pending_load())
    time.sleep(0.2)
    assert worker.get_transfer_results().finished_recving == set()  # still waiting
    channel.finish.set()
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    assert (recving, failed, settled) == ({"req-1"}, set(), ["req-1"])
    assert engine.submitted == [REMOTE.base_addr, REMOTE.base_addr + BLOCK]  # blocks 1 and 2
    worker.shutdown()
    acquire, release = channel.frames
    assert (acquire.transfer_id, acquire.remote_block_ids, acquire.incarnation) == (TID, [], "")
    assert acquire.wait_ms > 4000  # as long as the load may take
    assert release == protocol.Release(TID, True, acquire.owner)


def test_an_aborted_pending_pull_is_withdrawn_and_settled_without_a_failure(engine):
    channel = PendingSideChannel(granted_handoff())
    worker = make_worker(engine, channel, load_timeout_s=30.0)
    worker.start_load_kv(pending_load())
    time.sleep(0.1)
    started = time.monotonic()
    worker.start_load_kv(MooncakeConnectorMetadata(cancelled={"req-1"}))  # vLLM aborted it
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    assert time.monotonic() - started < 1.0
    assert (recving, failed, settled) == ({"req-1"}, set(), ["req-1"])  # vLLM frees the blocks
    stats = worker.get_stats().data
    assert (stats["cancelled"], stats["pull_failures"]) == (1, 0)
    worker.shutdown()
    acquire, release = channel.frames  # the wait withdrawn at the producer by its owner
    assert release == protocol.Release(TID, False, acquire.owner)
    assert engine.submitted == []


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"compat_hash": "other"}, "compat hash mismatch"),
        ({"prompt_len": 40, "remote_block_ids": [1, 2, 3]}, "prompt length 32"),
        ({"producer_engine_id": "someone-else"}, "'someone-else' (TP 1) holds the transfer"),
    ],
)
def test_a_pending_pull_checks_the_granted_handoff_before_a_byte_moves(engine, change, error):
    channel = PendingSideChannel(granted_handoff(**change))
    channel.finish.set()
    worker = make_worker(engine, channel, load_timeout_s=5.0)
    worker.start_load_kv(pending_load())
    recving, failed, _ = collect_until(worker, lambda r, f, s: s)
    assert (recving, failed) == ({"req-1"}, {"req-1"})  # through vLLM's failure policy
    assert engine.submitted == []
    worker.shutdown()
    acquire, release = channel.frames
    assert release == protocol.Release(TID, False, acquire.owner)


# ---- vLLM's upstream convention: a pending handoff named by its bootstrap ----------------------

XFER = "xfer-3f2b8c1e-9d4a-4e6f-8b1c-2a3d4e5f6a7b"


def upstream_load(bootstrap_addr: str, engine_id: str = "producer") -> MooncakeConnectorMetadata:
    params = {"transfer_id": XFER, "remote_bootstrap_addr": bootstrap_addr}
    pending = upstream.to_pending({**params, "remote_engine_id": engine_id})
    checks = protocol.HandoffChecks(
        prompt_len=32, compat_hash="hash", kv_heads=1, tp_size=1, block_size=16
    )
    return MooncakeConnectorMetadata(loads=[LoadSpec("req-1", pending, [], [3, 4], checks=checks)])


@pytest.fixture
def bootstrap():
    """A real bootstrap service of a TP1 producer "producer" whose side channel is port 16000."""
    port = free_port("127.0.0.1")
    settings = load_settings({"prefill_url": "127.0.0.1:15999", "bootstrap_port": port}, env={})
    service = BootstrapService(resolve(settings, "kv_producer", "producer", 1))
    yield service
    service.close()


def test_an_upstream_pull_asks_the_bootstrap_then_waits_for_the_prefill(engine, bootstrap):
    engine.done.set()
    channel = PendingSideChannel(granted_handoff(transfer_id=XFER))
    worker = make_worker(engine, channel, load_timeout_s=5.0)
    worker.start_load_kv(upstream_load(bootstrap.url))
    time.sleep(0.2)
    assert worker.get_transfer_results().finished_recving == set()  # waits for the prefill
    channel.finish.set()
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    worker.shutdown()
    assert (recving, failed, settled) == ({"req-1"}, set(), ["req-1"])
    assert engine.submitted == [REMOTE.base_addr, REMOTE.base_addr + BLOCK]
    acquire, release = channel.frames
    assert (acquire.transfer_id, acquire.remote_block_ids, acquire.wait_ms > 4000) == (
        XFER,
        [],
        True,
    )
    assert release == protocol.Release(XFER, True, acquire.owner)


@pytest.mark.parametrize("case", ["unknown engine", "no bootstrap"])
def test_an_upstream_pull_that_cannot_find_its_producer_fails_naming_why(
    engine, bootstrap, case, caplog
):
    channel = PendingSideChannel(granted_handoff(transfer_id=XFER))
    worker = make_worker(engine, channel, load_timeout_s=5.0)
    if case == "unknown engine":
        addr, expected = bootstrap.url, "unknown remote_engine_id 'gone'"
        meta = upstream_load(addr, "gone")
    else:
        addr = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        expected = f"the bootstrap {addr} did not answer /query"
        meta = upstream_load(addr)
    worker.start_load_kv(meta)
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    stats = worker.get_stats().data
    worker.shutdown()
    assert (recving, failed, settled) == ({"req-1"}, {"req-1"}, ["req-1"])  # vLLM's policy
    assert stats["pull_failures"] == 1 and channel.frames == []  # nothing sent anywhere
    assert expected in caplog.text


# ---- layer by layer (the producer's layerwise_handoff) ------------------------------------------

LOCAL_1 = protocol.MemSegment(base_addr=30_000, block_stride=BLOCK, block_len=BLOCK)
REMOTE_1 = protocol.MemSegment(base_addr=40_000, block_stride=BLOCK, block_len=BLOCK)


class LayeredSideChannel(PendingSideChannel):
    """A producer that grants while its prefill computes (layer 0 of 2 written), then answers
    each ``Await`` with the next of ``progress``."""

    def __init__(self, handoff, progress):
        super().__init__(handoff)
        self.finish.set()
        self.progress = list(progress)
        self.submitted_before: list[int] = []  # reads submitted before each await

    def call(self, address, frame, timeout_s, cancelled=None):
        if isinstance(frame, protocol.Acquire) and frame.wait_ms:
            self.frames.append(frame)
            segments = [REMOTE, REMOTE_1]
            return protocol.Granted(TID, "producer:1", segments, "inc", self.handoff, ready=0b01)
        if isinstance(frame, protocol.Await):
            self.frames.append(frame)
            self.submitted_before.append(len(self.engine.submitted))
            return self.progress.pop(0)
        return super().call(address, frame, timeout_s, cancelled)


def test_a_pull_granted_while_the_prefill_computes_reads_each_layer_as_it_is_written(engine):
    engine.done.set()
    channel = LayeredSideChannel(
        granted_handoff(),
        [protocol.Progress(TID, 0b11), protocol.Progress(TID, protocol.ALL_LAYERS)],
    )
    channel.engine = engine
    worker = make_worker(engine, channel, load_timeout_s=5.0)
    worker._puller._reader._segments = [LOCAL, LOCAL_1]
    worker.start_load_kv(pending_load())
    recving, failed, settled = collect_until(worker, lambda r, f, s: s)
    assert (recving, failed, settled) == ({"req-1"}, set(), ["req-1"])
    acquire, first, last, release = channel.frames
    assert acquire.layers_ok and first.known == 0b01 and last.known == 0b11
    # The warm-up, then blocks 1-2 of layer 0 (one entry) before the first await and those of
    # layer 1 after it; and the pull is done only once the prefill has finished.
    warm_up, layer0, layer1 = REMOTE.base_addr, REMOTE.base_addr + BLOCK, REMOTE_1.base_addr + BLOCK
    assert engine.submitted == [warm_up, layer0, layer1]
    assert channel.submitted_before == [2, 3]
    assert release == protocol.Release(TID, True, acquire.owner)
    stats = worker.get_stats().data
    assert (stats["pulls"], stats["layered"], stats["pull_failures"]) == (1, 1, 0)
    worker.shutdown()


def test_a_prefill_aborted_while_its_layers_are_read_fails_the_pull(engine):
    engine.done.set()
    refused = protocol.Refused(TID, "the prefill of transfer abab ended without a handover")
    channel = LayeredSideChannel(granted_handoff(), [refused])
    channel.engine = engine
    worker = make_worker(engine, channel, load_timeout_s=5.0)
    worker._puller._reader._segments = [LOCAL, LOCAL_1]
    worker.start_load_kv(pending_load())
    recving, failed, _ = collect_until(worker, lambda r, f, s: s)
    assert (recving, failed) == ({"req-1"}, {"req-1"})  # through vLLM's failure policy
    *_, release = channel.frames
    assert release.ok is False
    assert worker.get_stats().data["pull_failures"] == 1
    worker.shutdown()


def test_a_producer_worker_marks_each_layer_of_the_prompts_its_step_completes():
    settings = load_settings({"prefill_url": "127.0.0.1:17100", "layerwise_handoff": True}, env={})
    cfg = resolve(settings, "kv_producer", "producer", 1)
    worker = WorkerHalf(cfg, 0, "hash", 8)
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(layers_endpoint(cfg.host, cfg.base_port))
    names = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 10, 2)]
    kv = {name: torch.zeros(8, 4) for name in names}
    try:
        worker._open_marks(kv, [LOCAL] * len(kv))
        step = MooncakeConnectorMetadata(layer_marks=[TID], layers_token=b"k")
        worker.save_layer("model.layers.2.self_attn.attn", step)
        assert pull.poll(2000)
        done = msgspec.msgpack.decode(pull.recv(), type=LayerDone)
        # Segment order is vLLM's names sorted as strings: layer 2 is the fourth segment.
        assert done == LayerDone(b"k", 0, 3, [TID])
        # A step that completes no prompt.
        worker.save_layer("model.layers.0.self_attn.attn", MooncakeConnectorMetadata())
        assert not pull.poll(200)
        with pytest.raises(RuntimeError, match="one KV tensor per layer"):
            worker._open_marks(kv, [LOCAL] * 8)
    finally:
        worker.shutdown()
        pull.close()
