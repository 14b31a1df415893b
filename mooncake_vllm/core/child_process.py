"""The helper processes an engine keeps beside it (the lease server, the bootstrap service)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection


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
