"""The worker half in-process: a pull against a fake transfer engine and a fake side channel, its
outcome as vLLM collects it, and when its blocks are reported settled (no vLLM, no servers)."""

from __future__ import annotations

import threading
import time

import pytest

from mooncake_vllm.config import load_settings, resolve
from mooncake_vllm.engine import TransferEngine
from mooncake_vllm.protocol import Acquire, Granted, Handoff, MemSegment, Refused, Release, Released
from mooncake_vllm.step_metadata import LoadSpec, MooncakeConnectorMetadata
from mooncake_vllm.worker import WorkerHalf

BLOCK = 64
REMOTE = MemSegment(base_addr=10_000, block_stride=BLOCK, block_len=BLOCK)
LOCAL = MemSegment(base_addr=20_000, block_stride=BLOCK, block_len=BLOCK)


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

    def call(self, address, frame, timeout_s):
        self.frames.append(frame)
        if isinstance(frame, Release):
            return Released(frame.transfer_id)
        assert isinstance(frame, Acquire)
        return self.reply or Granted(frame.transfer_id, "producer:1", [REMOTE])

    def close(self):
        pass


def make_worker(engine, side_channel, load_timeout_s: float = 0.6) -> WorkerHalf:
    settings = load_settings(
        {"decode_url": "127.0.0.1:17000", "load_timeout_s": load_timeout_s}, env={}
    )
    worker = WorkerHalf(resolve(settings, "kv_consumer", "consumer", 1), 0, "hash", 8)
    # What register_kv_caches sets up around a real engine and real KV tensors.
    worker._engine = TransferEngine.wrapping(engine)
    worker._segments = [LOCAL]
    worker._client = side_channel
    return worker


def load(req_id: str = "req-1", blocks: int = 2) -> MooncakeConnectorMetadata:
    handoff = Handoff(
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
        self.seen.append(all(job.future.done() for job in list(self.worker._pulls.values())))

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
    assert isinstance(channel.frames[-1], Release) and channel.frames[-1].ok


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
    assert isinstance(channel.frames[-1], Release) and not channel.frames[-1].ok


def test_a_refused_acquire_is_a_failure_and_settles_at_once(engine):
    worker = make_worker(engine, FakeSideChannel(Refused("t-req-1", "unknown transfer id")))
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
    assert [type(f) for f in channel.frames] == [Release]
    worker.shutdown()


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
    assert [type(f) for f in channel.frames] == [Release] and not channel.frames[0].ok
