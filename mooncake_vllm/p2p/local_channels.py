"""Same-host channels between the halves of one engine, besides vLLM's per-step metadata.

- **wake-ups**, workers → scheduler: a worker says when something the scheduler must see has
  happened (a pull ended, a pull's deadline passed). While no request can run, the scheduler half
  waits for that (or for a new request) instead of letting vLLM step every millisecond: every step
  wakes vLLM's workers, whose message-queue readers then busy-wait for a second.
- **layer marks**, producer workers → lease server (``layerwise_handoff``): a layer of the
  prompts finishing in this step is written (``leases.process.LayerDone``).
- **claim**: a producer worker holds its address (an abstract socket named after it) for its
  lifetime, so a second engine configured with the same address fails before its transfer engine
  can publish metadata over ours.

ZeroMQ over abstract-namespace ipc sockets, named after the engine's own address, so they need no
cleanup and cannot be reached from another host.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)


def wake_endpoint(host: str, base_port: int) -> str:
    return f"ipc://@mooncake-vllm/{host}:{base_port}/wake"


def pool_wake_endpoint(engine_id: str, dp_rank: int) -> str:
    """The pool connector's wake-ups: one per engine and DP rank (it has no base port)."""
    return f"ipc://@mooncake-vllm/pool/{engine_id}/{dp_rank}/wake"


def layers_endpoint(host: str, base_port: int) -> str:
    """Where a producer's workers send ``LayerDone`` to its lease server (``layerwise_handoff``)."""
    return f"ipc://@mooncake-vllm/{host}:{base_port}/layers"


def claim(host: str, port: int) -> zmq.Socket:
    """Bind the claim socket for ``host:port`` (close it to give the address up); raises
    ``zmq.ZMQError`` if another engine on this host holds it."""
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(f"ipc://@mooncake-vllm/{host}:{port}/claim")
    except zmq.ZMQError:
        sock.close()
        raise
    return sock


class WakeSender:
    """Worker side: thread-safe, never blocks (a wake-up that cannot be queued is redundant)."""

    def __init__(self, endpoint: str):
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        self._sock.connect(endpoint)
        self._lock = threading.Lock()

    def wake(self) -> None:
        # Again: the queue already holds wake-ups; ZMQError: we are shutting down.
        with self._lock, contextlib.suppress(zmq.Again, zmq.ZMQError):
            self._sock.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        with self._lock:
            self._sock.close()


class WakeForwarder:
    """Scheduler side: a thread that turns each worker wake-up into ``on_wake()`` (which puts a
    no-op request into vLLM's input queue, so one wait covers wake-ups and new requests)."""

    def __init__(self, endpoint: str, on_wake: Callable[[], None]):
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._on_wake = on_wake
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mooncake-wake", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sock.poll(500):
                    continue
                while self._sock.poll(0):  # one forward for a burst
                    self._sock.recv()
                self._on_wake()
            except Exception:  # a missed wake-up costs latency, never correctness (MAX_REST_S)
                logger.exception("wake-up forwarding failed (continuing)")
        self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
