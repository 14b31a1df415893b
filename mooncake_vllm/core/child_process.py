"""The helper processes an engine keeps beside it (the lease server, the bootstrap service)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1


def spawn_child(module: str) -> tuple[subprocess.Popen, Connection]:
    """Start ``python -m module FD PARENT_PID``: FD is the child's end of a socket pair, the
    returned connection ours. The child learns of our end by end of file on FD, and of our death
    by PARENT_PID; the caller owns both (wait for the process, close the connection)."""
    ours, theirs = socket.socketpair()
    with theirs:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
        )
    return proc, Connection(ours.detach())


def die_with_parent(parent_pid: int) -> None:
    """In the child: the kernel's backstop for a parent that dies without closing the socket
    pair (SIGTERM when it is gone); exits at once if it is gone already."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before the signal was armed
        sys.exit(0)


def outlive_group_signal(parent_pid: int, logger: logging.Logger, meanwhile: str) -> None:
    """In the child: SIGTERM and SIGINT end it only once its engine core is gone (then the
    parent-death signal is the one that arrives). A signal to vLLM's whole process group
    (systemd's ``KillMode=control-group``, Ctrl-C) reaches the child too while the engine core
    drains under ``--shutdown-timeout``; the child goes on (``meanwhile`` says with what) until
    the engine core ends it by closing the socket pair."""

    def hold(signum: int, frame: object) -> None:
        if os.getppid() != parent_pid:
            raise SystemExit(0)
        logger.info("got %s: %s", signal.Signals(signum).name, meanwhile)

    signal.signal(signal.SIGTERM, hold)
    signal.signal(signal.SIGINT, hold)
