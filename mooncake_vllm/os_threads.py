"""OS-level settings of our threads: names (so ``top -H``, ``perf sched`` and ``py-spy`` tell them
apart from vLLM's; Python does not name native threads) and priority."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading

_PR_SET_NAME = 15
logger = logging.getLogger(__name__)


def name_this_thread(name: str) -> None:
    """Linux only (a no-op elsewhere); the kernel keeps the first 15 bytes."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


_priority_refused = False


def raise_priority(nice: int) -> bool:
    """Give the calling thread a lower nice value (Linux: per thread). A latency-critical thread
    that mostly sleeps (the side channel) otherwise waits tens of ms for a CPU behind vLLM's
    busy-waiting threads. Needs CAP_SYS_NICE; without it, says so once and carries on."""
    global _priority_refused
    if sys.platform != "linux":
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return True
    except OSError as e:
        if not _priority_refused:
            _priority_refused = True
            logger.info("cannot raise our side-channel thread's priority (%s); acquires may wait "
                        "for a CPU on a busy host", e)  # fmt: skip
        return False
