"""OS-level names for our threads, so ``top -H``, ``perf sched`` and ``py-spy`` tell them apart
from vLLM's (Python does not name native threads)."""

from __future__ import annotations

import contextlib
import ctypes
import sys

_PR_SET_NAME = 15


def name_this_thread(name: str) -> None:
    """Linux only (a no-op elsewhere); the kernel keeps the first 15 bytes."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
