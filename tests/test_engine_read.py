"""``TransferAgent.read`` and ``warm_up`` against a fake engine object: what the wrapper does with
pending, done, failed and refused entries, and with the deadline (no transfer engine, no vLLM)."""

from __future__ import annotations

import time

import pytest

from mooncake_vllm.core.planning import Region
from mooncake_vllm.transfer.engine import TransferAgent, TransferError, TransferTimeout


class FakeEngine:
    """Scripted ``transfer_check_status`` answers per region attempt: each region's attempts get
    the next script from ``scripts[src_addr]`` (a list of statuses; the last one repeats)."""

    def __init__(self, scripts: dict[int, list[list[int]]] | None = None, refuse: int = 0):
        self.scripts = {k: list(v) for k, v in (scripts or {}).items()}
        self.refuse = refuse  # submits refused (batch id 0) before accepting
        self.next_bid = 1
        self.live: dict[int, list[int]] = {}
        self.submitted: list[int] = []
        self.status_calls = 0

    def batch_transfer_async_read(self, peer, dsts, srcs, lens):
        assert len(srcs) == 1, "one entry per batch"
        if self.refuse:
            self.refuse -= 1
            return 0
        bid, self.next_bid = self.next_bid, self.next_bid + 1
        runs = self.scripts.get(srcs[0]) or [[1]]
        script = runs.pop(0) if len(runs) > 1 else list(runs[0])
        self.live[bid] = script
        self.submitted.append(srcs[0])
        return bid

    def transfer_check_status(self, bid):
        self.status_calls += 1
        script = self.live[bid]
        status = script.pop(0) if len(script) > 1 else script[0]
        if status != 0:
            del self.live[bid]  # the real engine frees the batch on a final status
        return status

    def register_memory(self, addr, length, location):
        return 0


def regions(n: int) -> list[Region]:
    return [Region(src_addr=100 + i, dst_addr=200 + i, length=10) for i in range(n)]


def read(fake: FakeEngine, n: int, deadline_s: float = 5.0, stall_s: float = 1.0, **kw):
    engine = TransferAgent.wrapping(fake)
    return engine.read(
        "peer:1",
        regions(n),
        deadline=time.monotonic() + deadline_s,
        stall_s=stall_s,
        max_in_flight=kw.pop("max_in_flight", 8),
        **kw,
    )


def test_pending_entries_are_polled_until_done_and_nothing_is_left_in_flight():
    fake = FakeEngine({100: [[0, 0, 0, 1]], 101: [[0, 1]]})
    result = read(fake, 3)
    assert (result.entries, result.bytes, result.retries) == (3, 30, 0)
    assert fake.live == {}


def test_a_failed_entry_is_read_again():
    fake = FakeEngine({101: [[0, -1], [1]]})
    result = read(fake, 2)
    assert result.retries == 1
    assert fake.submitted.count(101) == 2
    assert fake.live == {}


def test_a_refused_submit_is_retried():
    fake = FakeEngine(refuse=2)
    assert read(fake, 1).retries == 2


def test_no_more_attempts_than_in_flight_allows():
    fake = FakeEngine({100 + i: [[0, 0, 1]] for i in range(6)})
    seen = []
    orig = fake.batch_transfer_async_read

    def submit(*a):
        seen.append(len(fake.live))
        return orig(*a)

    fake.batch_transfer_async_read = submit
    read(fake, 6, max_in_flight=2)
    assert max(seen) < 2


def test_past_the_deadline_the_read_fails_but_only_once_every_entry_has_ended():
    # Entry 100 is done at once; 101 stays pending for ~0.3 s of polls; 102 fails every time.
    fake = FakeEngine({101: [[0] * 60 + [1]], 102: [[-1]]})
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        read(fake, 3, deadline_s=0.2, stall_s=0.05)
    assert fake.live == {}, "read returned while an entry could still write"
    assert time.monotonic() - start < 2.0


def test_no_retry_starts_that_could_not_end_by_the_deadline():
    fake = FakeEngine({101: [[-1]]})
    with pytest.raises(TransferTimeout):
        read(fake, 2, deadline_s=0.5, stall_s=1.0)
    assert fake.submitted == [100, 101]  # no retry: it would end past the deadline


def test_a_peer_that_delivers_nothing_fails_the_read_without_retries():
    fake = FakeEngine({100: [[0, -1]], 101: [[0, 0, -1]]})
    with pytest.raises(TransferError, match="no progress from the peer"):
        read(fake, 2)
    assert fake.submitted == [100, 101]
    assert fake.live == {}


def test_an_abandoned_pull_submits_nothing():
    fake = FakeEngine()
    with pytest.raises(TransferError, match="abandoned"):
        read(fake, 3, should_start=lambda: False)
    assert fake.submitted == []


def test_polling_sleeps_between_status_calls():
    fake = FakeEngine({100: [[0] * 300 + [1]]})
    start = time.monotonic()
    read(fake, 1)
    # 300 polls spinning take about a millisecond; with the growing sleep, a good part of a second.
    assert time.monotonic() - start > 0.3


def test_warm_up_reads_into_scratch_once_per_peer_and_retries():
    fake = FakeEngine({7: [[-1], [1]]})
    engine = TransferAgent.wrapping(fake)
    engine.warm_up("peer:1", 7, deadline=time.monotonic() + 5, stall_s=0.01)
    engine.warm_up("peer:1", 7, deadline=time.monotonic() + 5, stall_s=0.01)
    assert fake.submitted == [7, 7]  # one failed attempt, one success, then nothing


def test_warm_up_gives_up_at_the_deadline():
    fake = FakeEngine({7: [[-1]]})
    engine = TransferAgent.wrapping(fake)
    with pytest.raises(TransferError, match="no read from the peer"):
        engine.warm_up("peer:1", 7, deadline=time.monotonic() + 0.05, stall_s=0.01)
