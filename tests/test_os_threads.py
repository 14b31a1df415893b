"""Thread priorities of the side channel: real-time where the process may, restored after a call."""

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from mooncake_vllm import os_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux only")


def _threads() -> dict[int, tuple[str, int]]:
    """This process's threads: native id -> (name, scheduling policy, field 41 of stat)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (name, int(fields[38]))  # fields[0] is the 3rd field
    return out


def test_critical_section_restores_the_policy() -> None:
    seen = {}

    def run() -> None:
        with os_threads.latency_critical_section():
            seen["inside"] = os.sched_getscheduler(0)
        seen["after"] = os.sched_getscheduler(0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    expected_inside = os.SCHED_FIFO if os_threads.realtime_allowed() else os.SCHED_OTHER
    assert seen == {"inside": expected_inside, "after": os.SCHED_OTHER}


def test_zmq_io_thread_runs_realtime_where_allowed() -> None:
    before = set(_threads())
    ctx = os_threads.latency_zmq_context()
    sock = ctx.socket(os_threads.zmq.PAIR)
    try:
        sock.bind("tcp://127.0.0.1:0")
        deadline = time.monotonic() + 5
        while not (io := [v for k, v in _threads().items() if k not in before and "IO" in v[0]]):
            assert time.monotonic() < deadline, "the context's I/O thread never started"
            time.sleep(0.01)
        policy = io[0][1]
        expected = os.SCHED_FIFO if os_threads.realtime_allowed() else os.SCHED_OTHER
        assert policy == expected
    finally:
        sock.close()
        ctx.term()


def test_latency_critical_thread_gets_realtime_or_nice() -> None:
    got = {}

    def run() -> None:
        got["applied"] = os_threads.make_latency_critical(-5)
        got["policy"] = os.sched_getscheduler(0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if os_threads.realtime_allowed():
        assert got == {"applied": "realtime", "policy": os.SCHED_FIFO}
    else:
        assert got["applied"] in ("nice", "none") and got["policy"] == os.SCHED_OTHER


def test_adopted_threads_are_named_and_realtime_where_allowed() -> None:
    release = threading.Event()
    started = threading.Event()
    t = threading.Thread(target=lambda: (started.set(), release.wait(5)))
    t.start()
    started.wait(5)
    try:
        os_threads.adopt_native_threads([t.native_id], "mc-test", realtime=True)
        name, policy = _threads()[t.native_id]
        expected = os.SCHED_FIFO if os_threads.realtime_allowed() else os.SCHED_OTHER
        assert (name, policy) == ("mc-test", expected)
    finally:
        release.set()
        t.join()
