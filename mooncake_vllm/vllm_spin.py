"""How long vLLM's shared-memory queue readers busy-wait in this process.

A vLLM worker reads its engine core's steps, and the engine core its workers' answers, from
shared-memory queues (``shm_broadcast.MessageQueue``). After every message such a reader spins
(``sched_yield`` in a Python loop) for ``SpinCondition.busy_loop_s`` (1 s, not configurable)
before it sleeps on a ZeroMQ notification. An engine that steps at least once a second therefore
keeps a core busy per reader even with nothing to compute, and the spinning thread takes its
process's GIL between yields. On a host where prefill and decode share CPUs that costs the other
engine, and the transfer engine's threads, a core. Both of our connectors shorten the spin of the
readers of their own process (``vllm_busy_loop_s``, 20 ms by default): decode steps closer together
than that still find the reader spinning, so a running batch pays no wake-up; only the first step
after a pause pays ZeroMQ's (tens of microseconds).

While such a reader spins, it drops the GIL at every yield but takes it straight back, so another
Python thread of the process (a pull polling its transfer, the side channel answering an acquire)
gets the GIL only when Python's switch interval (5 ms) forces a hand-over: up to 5 ms per poll or
submit. The P2P connector lowers the interval in its worker processes, where pulls run
(``gil_switch_interval_s``; with ``--distributed-executor-backend uni`` the worker is the engine
core's process). Not in a separate engine core: two A/B serving runs on 2 cores with it there gave
acquire p99s of 200 ms where the pair without it had 2-10 ms (README, How a request flows).
"""

from __future__ import annotations

import gc
import logging
import sys
import time

logger = logging.getLogger(__name__)


def shorten_queue_spin(busy_loop_s: float | None) -> int:
    """Sets ``busy_loop_s`` of every shared-memory queue reader already made in this process and
    returns how many. vLLM makes them before the connector (the worker's step queue, the engine
    core's answer queue); a process without them (``--distributed-executor-backend uni``) has none.
    ``None`` leaves vLLM's own value."""
    if busy_loop_s is None:
        return 0
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError as e:  # a vLLM without it has no spinning reader we know of
        logger.info("vllm_busy_loop_s not applied: %s", e)
        return 0
    started_s = time.monotonic()
    # issubclass(type(...)), not isinstance: isinstance also asks an object's __class__,
    # which some of torch's deprecated objects answer with a warning.
    readers = [
        obj for obj in gc.get_objects() if issubclass(type(obj), SpinCondition) and obj.is_reader
    ]
    for reader in readers:
        reader.busy_loop_s = busy_loop_s
    if readers:
        logger.info(
            "vLLM queue readers in this process spin %.3f s after a message instead of 1 s "
            "(vllm_busy_loop_s; %d reader(s), found in %.0f ms)",
            busy_loop_s,
            len(readers),
            (time.monotonic() - started_s) * 1000,
        )
    return len(readers)


def shorten_gil_switch_interval(interval_s: float | None) -> None:
    """Lets a thread waiting for this process's GIL force a hand-over after ``interval_s`` instead
    of Python's 5 ms. ``None`` leaves it as it is."""
    if interval_s is None:
        return
    sys.setswitchinterval(interval_s)
    logger.info("GIL switch interval in this process: %.2f ms (gil_switch_interval_s)",
                interval_s * 1000)  # fmt: skip
