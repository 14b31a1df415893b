"""OS-level settings of our threads: names (so ``top -H``, ``perf sched`` and ``py-spy`` tell them
apart from vLLM's; Python does not name native threads) and priority.

Priority follows one process-wide policy, the connectors' ``thread_priority`` setting
(``set_policy``): ``off`` leaves every thread as the OS made it; ``nice`` (the default) lowers the
nice value of the threads that mostly sleep and must answer within a millisecond (pull threads, the
lease server), where the process may (CAP_SYS_NICE: a no-op for an ordinary user on a shared host);
``realtime`` gives them, the transfer engine's TCP threads and our ZeroMQ I/O threads SCHED_FIFO 1
where allowed, else the ``nice`` behaviour. None of them spins, so neither can take a core from
others for longer than a transfer; docs/benchmarks.md has the A/B behind the default."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
from collections.abc import Iterator
from functools import cache

import zmq

_PR_SET_NAME = 15
# The lowest real-time priority: above every ordinary (SCHED_OTHER) thread, below the kernel's.
_RT_PRIORITY = 1
logger = logging.getLogger(__name__)


def name_this_thread(name: str) -> None:
    """Linux only (a no-op elsewhere); the kernel keeps the first 15 bytes."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


_priority_refused = False
Policy = str  # one of POLICIES
# The accepted values of the ``thread_priority`` setting (``settings.Settings``'s Literal).
POLICIES = ("off", "nice", "realtime")
_policy: Policy = "nice"


def set_policy(policy: Policy) -> None:
    """The process's ``thread_priority`` (set once, when a connector is built)."""
    global _policy
    if policy not in POLICIES:
        accepted = ", ".join(map(repr, POLICIES))
        raise ValueError(f"thread_priority={policy!r}: accepted {accepted}")
    _policy = policy


def policy() -> Policy:
    return _policy


def raise_priority(nice: int) -> bool:
    """Give the calling thread a lower nice value (Linux: per thread). A latency-critical thread
    that mostly sleeps (the side channel) otherwise waits tens of ms for a CPU behind vLLM's
    busy-waiting threads. Needs CAP_SYS_NICE; without it, says so once and carries on."""
    global _priority_refused
    if sys.platform != "linux" or _policy == "off":
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return True
    except OSError as e:
        if not _priority_refused:
            _priority_refused = True
            logger.info(
                "cannot raise the priority of our latency-critical threads (%s); "
                "acquires may wait for a CPU on a busy host",
                e,
            )
        return False


def realtime_allowed() -> bool:
    """Whether our threads take SCHED_FIFO: the policy asks for it and the process may (root or
    CAP_SYS_NICE, and a cgroup that grants real-time time)."""
    return _policy == "realtime" and _realtime_permitted()


@cache
def _realtime_permitted() -> bool:
    """Probed once on a throwaway thread."""
    if sys.platform != "linux":
        return False
    allowed = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_RT_PRIORITY))
            allowed.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="mooncake-rt-probe")
    t.start()
    t.join()
    return bool(allowed)


# Measured (perf sched, 1900-token prompts at c=4 on 2 cores): at nice 0 the lease server's
# side-channel thread waited 11.7 ms on average and up to 168 ms for a CPU after each wake-up; at
# nice -10, 1.2 ms and 32 ms.
LATENCY_CRITICAL_NICE = -10


def unpin(tid: int = 0) -> bool:
    """Let thread ``tid`` (0: the calling one) run on every CPU the process may use.

    vLLM's CPU worker binds its OpenMP threads, its main thread among them, to the cores it
    picks (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``: on a 2-core host with a KV connector,
    one core for every engine). Threads started from that thread inherit the binding: the
    transfer engine's and the store client's I/O and heartbeat threads, our pull threads. Pinned
    to the one core where the engines' workers spin, a holder's store threads were starved for
    10 s and more: reads stalled (-707, -800) and mooncake_master expired the holder for missed
    heartbeats, dropping every object it held (docs/pool.md, Threads). The kernel's cpuset
    still applies: CPUs outside it are ignored. Returns whether it was applied."""
    if sys.platform != "linux" or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(tid, range(os.cpu_count() or 1))
        return True
    except OSError:
        return False


def make_latency_critical(nice: int = LATENCY_CRITICAL_NICE) -> str:
    """For a thread that mostly sleeps and must answer within a millisecond: real-time priority
    (SCHED_FIFO 1) where allowed, else ``nice``. A SCHED_OTHER thread waits up to a scheduler
    slice behind vLLM's busy-waiting workers at every wake-up; a real-time one runs at once (the
    kernel still caps real-time threads at 95 % of a CPU). It is also freed from the cores vLLM
    bound its creator to (``unpin``). Returns which priority was applied."""
    unpin()
    if realtime_allowed():
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_RT_PRIORITY))
            return "realtime"
    return "nice" if raise_priority(nice) else "none"


@contextlib.contextmanager
def latency_critical_section() -> Iterator[None]:
    """Real-time priority for the calling thread for the duration of a short wait (a side-channel
    round trip), so the reply is picked up as soon as it lands; restored afterwards."""
    if not realtime_allowed():
        yield
        return
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_RT_PRIORITY))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, before[0], before[1])


def native_threads() -> dict[int, str]:
    """This process's threads: native id -> name. Empty where there is no /proc."""
    out = {}
    with contextlib.suppress(OSError):
        for task in os.scandir("/proc/self/task"):
            # OSError: a thread that just ended
            with contextlib.suppress(OSError), open(f"{task.path}/comm") as f:
                out[int(task.name)] = f.read().strip()
    return out


def adopt_native_threads(tids: list[int], name: str, realtime: bool) -> None:
    """Name threads a native library started for us (they inherit their creator's name and its
    CPU binding), free them from the cores vLLM bound their creator to (``unpin``), and give them
    real-time priority if ``realtime`` and allowed. Threads gone meanwhile are skipped."""
    for tid in tids:
        unpin(tid)
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:15])
        if realtime and realtime_allowed():
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(_RT_PRIORITY))


def latency_zmq_context() -> zmq.Context:
    """A ZeroMQ context of our own whose I/O thread runs at real-time priority where allowed: each
    side-channel frame passes through the I/O threads of both processes, two wake-ups per
    direction. (libzmq aborts if it cannot apply the policy, hence the probe first.)"""
    ctx = zmq.Context(io_threads=1)
    if realtime_allowed():
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_FIFO)
        ctx.set(zmq.THREAD_PRIORITY, _RT_PRIORITY)
    return ctx
