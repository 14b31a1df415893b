"""The load jobs both worker halves share (``core.loads.LoadJobs``): which outcome vLLM gets and
when, and when a load is reported settled, driven by a fake clock and an executor whose jobs end
when the test says so (no threads, no servers)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import pytest

from mooncake_vllm.core.loads import REPORT_AFTER_S, LoadJob, LoadJobs, LoadOutcome
from mooncake_vllm.core.worker_stats import WorkerStats
from mooncake_vllm.pool.stats import PoolStats

TIMEOUT_S = 1.0
OVERDUE_S = TIMEOUT_S + REPORT_AFTER_S  # the first time a busy job is reported failed is past it


class FakeClock:
    now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class ManualExecutor:
    """Runs a submitted load only when the test ends it with ``finish``."""

    def __init__(self) -> None:
        self.pending: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.pending.append((future, fn, args))
        return future

    def finish(self) -> None:
        for future, fn, args in self.pending:
            future.set_result(fn(*args))
        self.pending.clear()


def _done(job: LoadJob[LoadOutcome]) -> LoadOutcome:
    return LoadOutcome(job.req_id, ok=True)


def _overdue(job: LoadJob[LoadOutcome]) -> LoadOutcome:
    return LoadOutcome(job.req_id, ok=False, reason="overdue")


def _collect(jobs: LoadJobs[LoadOutcome]) -> list[str]:
    return [f"{o.req_id} {'done' if o.ok else o.reason}" for o in jobs.collect(_overdue)]


# A script: (seconds after submit, what happens, [expected outcomes, expected settled]).
CASES = {
    "ends in time: its outcome, settled at once": (
        True,
        [(0.5, "collect", [], []), (0.5, "finish"), (0.5, "collect", ["req-1 done"], ["req-1"])],
    ),
    "ends past the deadline but before it is reported: its own outcome": (
        True,
        [
            (OVERDUE_S, "collect", [], []),
            (OVERDUE_S, "finish"),
            (9.0, "collect", ["req-1 done"], ["req-1"]),
        ],
    ),
    "busy past the deadline: failed at once, settled only when it ends": (
        True,
        [
            (OVERDUE_S + 0.01, "collect", ["req-1 overdue"], []),
            (5.0, "collect", [], []),
            (9.0, "finish"),
            (9.0, "collect", [], ["req-1"]),
        ],
    ),
    "not awaited: no outcome, settled when it ends": (
        False,
        [(9.0, "collect", [], []), (9.0, "finish"), (9.0, "collect", [], ["req-1"])],
    ),
}


@pytest.mark.parametrize(("awaited", "script"), CASES.values(), ids=CASES.keys())
def test_each_outcome_reaches_vllm_once_and_each_load_settles_once_it_ended(awaited, script):
    clock, executor = FakeClock(), ManualExecutor()
    jobs: LoadJobs[LoadOutcome] = LoadJobs(executor, clock=clock)
    start = clock.now_s
    jobs.submit("req-1", _done, TIMEOUT_S, awaited=awaited)
    for at_s, action, *expected in script:
        clock.now_s = start + at_s
        if action == "finish":
            executor.finish()
            continue
        outcomes, settled = expected
        assert _collect(jobs) == outcomes, at_s
        meta = jobs.worker_meta()
        assert (meta.settled if meta else []) == settled, at_s
    assert jobs.running() == 0
    assert (_collect(jobs), jobs.worker_meta()) == ([], None)  # nothing twice


def test_a_load_that_ends_after_it_was_reported_failed_is_logged_once(caplog):
    clock, executor = FakeClock(), ManualExecutor()
    jobs: LoadJobs[LoadOutcome] = LoadJobs(executor, noun="pull", clock=clock)
    jobs.submit("req-1", _done, TIMEOUT_S)
    clock.now_s += 5.0
    assert _collect(jobs) == ["req-1 overdue"]
    executor.finish()
    with caplog.at_level(logging.INFO, logger="mooncake_vllm.core.loads"):
        jobs.collect(_overdue)
        jobs.collect(_overdue)
    assert caplog.messages == [
        "request req-1: the pull reported failed at its deadline has ended; its blocks are unpinned"
    ]


@pytest.mark.parametrize(
    ("first", "then", "results"),
    [
        ("start_writing", "abandon", (True, False)),  # the read runs on: "still in the read"
        ("abandon", "start_writing", (True, False)),  # abandoned first: nothing is written
        ("abandon", "abandon", (True, True)),
    ],
)
def test_a_job_abandoned_before_its_first_write_never_writes(first, then, results):
    job: LoadJob[LoadOutcome] = LoadJob("req-1", deadline_s=0.0, awaited=True)
    assert (getattr(job, first)(), getattr(job, then)()) == results


def test_the_scheduler_is_woken_once_a_load_has_ended_or_is_due_to_be_reported():
    executor = ManualExecutor()
    woken = threading.Semaphore(0)
    seen_running: list[int] = []

    def wake() -> None:
        seen_running.append(jobs.running())
        woken.release()

    jobs: LoadJobs[LoadOutcome] = LoadJobs(executor, wake=wake)
    jobs.submit("req-1", _done, 10.0)
    executor.finish()
    assert woken.acquire(timeout=1.0)
    assert seen_running == [0]  # woken after the future is done, so the outcome is collectable
    jobs.submit("req-2", _done, 0.0)  # never ends: woken REPORT_AFTER_S past its deadline
    assert woken.acquire(timeout=REPORT_AFTER_S + 2.0)
    assert seen_running == [0, 1]


def test_worker_stats_are_handed_over_whole_and_only_when_not_empty():
    stats = WorkerStats(PoolStats)
    assert stats.take() is None
    with stats.update() as s:
        s.count("loads")
    taken = stats.take()
    assert taken is not None and taken.data["loads"] == 1
    assert stats.take() is None  # counted once
