"""Two same-host channels between the halves of one engine, besides vLLM's per-step metadata.

Both exist so that nothing waits for an engine step, and so that vLLM need not step when there is
nothing to compute (every step wakes vLLM's workers, whose readers then busy-wait for a second).

- **holds**, scheduler → producer worker: ``request_finished`` sends the blocks to hold straight to
  every worker rank's side-channel thread, before the handoff leaves the engine-core process. A
  consumer's ``Acquire`` therefore finds the lease at once instead of after the producer's next
  step (which could be seconds away under load).
- **wake-ups**, workers → scheduler: a worker says when something the scheduler must see has
  happened (a pull ended, a lease ended, a pull's deadline passed). While it has nothing to
  schedule, the scheduler half waits for that (or for a new request) instead of letting vLLM
  step every millisecond.

ZeroMQ over abstract-namespace ipc sockets, named after the engine's own (bound, hence unique)
address, so they need no cleanup and cannot be reached from another host.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import zmq

from mooncake_vllm.protocol import Hold, encode_frame

logger = logging.getLogger(__name__)


def hold_endpoint(host: str, side_channel_port: int) -> str:
    return f"ipc://@mooncake-vllm/{host}:{side_channel_port}/holds"


def wake_endpoint(host: str, base_port: int) -> str:
    return f"ipc://@mooncake-vllm/{host}:{base_port}/wake"


class HoldSender:
    """Scheduler side: one PUSH socket per worker rank (PUSH to several peers would round-robin)."""

    def __init__(self, endpoints: list[str]):
        self._ctx = zmq.Context.instance()
        self._socks = []
        for endpoint in endpoints:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)  # queued until the worker binds (it does before serving)
            self._socks.append(sock)

    def send(self, hold: Hold) -> None:
        payload = encode_frame(hold)
        for sock in self._socks:
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again:  # the worker is gone or 1000 holds behind: the lease TTL covers it
                logger.warning("hold of %s not delivered: worker not reading", hold.transfer_id)

    def close(self) -> None:
        for sock in self._socks:
            sock.close()


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
