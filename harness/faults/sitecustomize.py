"""Test-only: freezes a producer's worker right after its lease server grants a lease.

Python imports this module at the start of every process with this directory on its ``PYTHONPATH``
(``harness.faults.freeze_after_grant_env``). It does nothing unless the process is a lease server
(``python -m mooncake_vllm.p2p.leases.process``) and MOONCAKE_VLLM_TEST_FREEZE_TRIGGER names a
trigger file. Then, on the first grant after the test creates that file, it deletes the file and
SIGSTOPs the worker of the granting TP rank and waits until all its threads have stopped, before
the ``Granted`` reply is sent.

The seams it relies on in the connector: ``LeaseServer._servers`` (one ``SideChannelServer`` per
TP rank), ``LeaseServer._layouts[rank].worker_pid``, and ``SideChannelServer._on_grant`` (called
with the transfer id right before ``Granted`` is sent).
"""

import builtins
import os
import signal
import sys
import time

TRIGGER_ENV = "MOONCAKE_VLLM_TEST_FREEZE_TRIGGER"  # harness.faults.FREEZE_TRIGGER_ENV
LEASE_SERVER = "mooncake_vllm.p2p.leases.process"


def _is_lease_server(argv: list[str]) -> bool:
    # sys.argv does not name the module yet while site runs: the original command line does.
    return "-m" in argv and argv[argv.index("-m") + 1 :][:1] == [LEASE_SERVER]


def _freeze_on_next_armed_grant(server, trigger: str) -> None:
    for rank, side_channel in enumerate(server._servers):
        before = side_channel._on_grant

        def on_grant(transfer_id: str, rank=rank, before=before) -> None:
            if before is not None:
                before(transfer_id)
            try:
                os.unlink(trigger)  # armed: freeze this once
            except FileNotFoundError:
                return
            pid = server._layouts[rank].worker_pid
            os.kill(pid, signal.SIGSTOP)
            _wait_until_stopped(pid)

        side_channel._on_grant = on_grant


def _wait_until_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Returns once every thread of ``pid`` is stopped. ``kill`` only queues SIGSTOP: one thread
    takes it and then stops the others, and until it has run, another thread woken by the
    consumer's read (the transfer engine's io thread) can still serve it. On two busy cores that
    took long enough for a read to beat the stop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            states = []
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread ended while listed: look again
            states = None
        if states is not None and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.0005)
    raise RuntimeError(f"worker {pid} not stopped {timeout_s} s after SIGSTOP")


def _install(trigger: str) -> None:
    """``python -m`` runs the lease server as ``__main__``, so importing its module here would
    patch a copy nobody uses: the class is caught as its ``class`` statement creates it."""
    build_class = builtins.__build_class__

    def build_and_wrap(func, name, *bases, **kwargs):
        cls = build_class(func, name, *bases, **kwargs)
        if name == "LeaseServer" and cls.__module__ in ("__main__", LEASE_SERVER):
            builtins.__build_class__ = build_class  # the one class to wrap
            init = cls.__init__

            def __init__(self, *args, **kw):
                init(self, *args, **kw)
                _freeze_on_next_armed_grant(self, trigger)

            cls.__init__ = __init__
        return cls

    builtins.__build_class__ = build_and_wrap


if os.environ.get(TRIGGER_ENV) and _is_lease_server(sys.orig_argv):
    _install(os.environ[TRIGGER_ENV])
