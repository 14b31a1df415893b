"""Thread priorities under each ``thread_priority`` policy, read back from the kernel. The
expected values come from the policy and from whether this process may take real-time priority
(root, as in CI and on these machines), never from the code under test."""

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import get_args

import pytest

from mooncake_vllm.core import os_threads
from mooncake_vllm.core.settings import SharedSettings

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux only")

ROOT = os.geteuid() == 0  # may take SCHED_FIFO and lower nice values


@pytest.fixture
def policy(request):
    before = os_threads.policy()
    os_threads.set_policy(request.param)
    yield request.param
    os_threads.set_policy(before)


def _threads() -> dict[int, tuple[str, int]]:
    """This process's threads: native id -> (name, scheduling policy, field 41 of stat)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (name, int(fields[38]))  # fields[0] is the 3rd field
    return out


def _on_a_thread(fn):
    got = {}
    t = threading.Thread(target=lambda: got.update(fn()))
    t.start()
    t.join()
    return got


def _fifo_if(policy: str) -> int:
    return os.SCHED_FIFO if policy == "realtime" and ROOT else os.SCHED_OTHER


@pytest.mark.parametrize("policy", ["off", "nice", "realtime"], indirect=True)
def test_a_latency_critical_thread_gets_what_the_policy_says(policy):
    def run():
        applied = os_threads.make_latency_critical(-5)
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return {"applied": applied, "sched": os.sched_getscheduler(0), "nice": nice}

    got = _on_a_thread(run)
    expected = {
        "off": {"applied": "none", "sched": os.SCHED_OTHER, "nice": os.nice(0)},
        "nice": {
            "applied": "nice" if ROOT else "none",
            "sched": os.SCHED_OTHER,
            "nice": -5 if ROOT else os.nice(0),
        },
        "realtime": {
            "applied": "realtime" if ROOT else "none",
            "sched": _fifo_if("realtime"),
            "nice": os.nice(0),
        },
    }[policy]
    assert got == expected


@pytest.mark.parametrize("policy", ["off", "nice", "realtime"], indirect=True)
def test_critical_section_is_realtime_only_under_that_policy_and_restores(policy):
    def run():
        with os_threads.latency_critical_section():
            inside = os.sched_getscheduler(0)
        return {"inside": inside, "after": os.sched_getscheduler(0)}

    assert _on_a_thread(run) == {"inside": _fifo_if(policy), "after": os.SCHED_OTHER}


@pytest.mark.parametrize("policy", ["nice", "realtime"], indirect=True)
def test_zmq_io_thread_is_realtime_only_under_that_policy(policy):
    before = set(_threads())
    ctx = os_threads.latency_zmq_context()
    sock = ctx.socket(os_threads.zmq.PAIR)
    try:
        sock.bind("tcp://127.0.0.1:0")
        deadline = time.monotonic() + 5
        while not (io := [v for k, v in _threads().items() if k not in before and "IO" in v[0]]):
            assert time.monotonic() < deadline, "the context's I/O thread never started"
            time.sleep(0.01)
        assert io[0][1] == _fifo_if(policy)
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("policy", ["nice", "realtime"], indirect=True)
def test_adopted_native_threads_are_named_and_realtime_only_under_that_policy(policy):
    release, started = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (started.set(), release.wait(5)))
    t.start()
    started.wait(5)
    try:
        os_threads.adopt_native_threads([t.native_id], "mc-test", realtime=True)
        assert _threads()[t.native_id] == ("mc-test", _fifo_if(policy))
    finally:
        release.set()
        t.join()


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="thread_priority='fast'"):
        os_threads.set_policy("fast")


def test_the_setting_accepts_exactly_the_policies():
    field = SharedSettings.model_fields["thread_priority"]
    assert get_args(field.annotation) == os_threads.POLICIES


def _in_thread(fn):
    """Run ``fn(tid)`` on a new thread pinned to one CPU, as vLLM's CPU worker pins its main
    thread; returns the CPUs that thread may run on afterwards."""
    out = {}

    def body():
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        fn(threading.get_native_id())
        out["cpus"] = os.sched_getaffinity(0)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["cpus"]


CPUS = os.sched_getaffinity(0)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell pinned from free")
def test_a_thread_pinned_to_one_core_is_freed_by_unpin():
    assert _in_thread(lambda tid: None) == {min(CPUS)}  # the pin holds without unpin
    assert _in_thread(lambda tid: os_threads.unpin()) == CPUS


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell pinned from free")
def test_native_threads_adopted_from_a_pinned_creator_and_pull_threads_are_unpinned():
    assert _in_thread(lambda tid: os_threads.adopt_native_threads([tid], "t", False)) == CPUS
    assert _in_thread(lambda tid: os_threads.make_latency_critical()) == CPUS
