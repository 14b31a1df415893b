"""The side channel between a consumer worker and the producer worker of the same TP rank.

ZeroMQ ROUTER on the producer, one DEALER per peer on the consumer; frames from ``protocol``.
The producer answers ``Acquire`` with the lease's memory layout (or a refusal) and ``Release`` with
``Released``. The leases themselves arrive as ``Hold`` frames from this engine's scheduler half over
a local ipc socket (``local_channels``), before the handoff leaves the engine, so an ``Acquire``
normally finds its lease at once; one for a transfer id not heard of yet waits (answered as soon as
the hold arrives) up to ``unknown_wait_s`` before it is refused. The thread sleeps in ``poll``
until a frame arrives or a lease or a waiting acquire has a deadline: no periodic tick.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from mooncake_vllm.leases import Lease, LeaseTable
from mooncake_vllm.protocol import (
    Acquire,
    Frame,
    Granted,
    Hold,
    MemSegment,
    Refused,
    Release,
    Released,
    decode_frame,
    encode_frame,
)

logger = logging.getLogger(__name__)

# Test hook (tests/test_new_user_setup.py): a producer that freezes right after granting a
# transfer whose id starts with this prefix, as a producer stopped mid-pull would. Unset: off.
_FREEZE_PREFIX = os.environ.get("MOONCAKE_VLLM_TEST_FREEZE_AFTER_GRANT", "")


class SideChannelError(RuntimeError):
    pass


@dataclass
class _Waiting:
    identity: bytes
    frame: Acquire
    until_s: float


class SideChannelServer:
    """Serves one producer worker's leases; runs in its own thread until ``close``."""

    def __init__(
        self,
        host: str,
        port: int,
        leases: LeaseTable,
        layout: Callable[[], tuple[str, list[MemSegment]]],
        on_hold: Callable[[Hold], None],
        hold_endpoint: str | None = None,
        unknown_wait_s: float = 5.0,
        max_idle_s: float = 1.0,
    ):
        self._leases = leases
        self._layout = layout
        self._on_hold = on_hold
        self._unknown_wait_s = unknown_wait_s
        self._max_idle_s = max_idle_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._holds: zmq.Socket | None = None
        try:
            self._sock.bind(f"tcp://{host}:{port}")
            if hold_endpoint is not None:
                self._holds = self._ctx.socket(zmq.PULL)
                self._holds.setsockopt(zmq.LINGER, 0)
                self._holds.bind(hold_endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            if self._holds is not None:
                self._holds.close()
            raise SideChannelError(
                f"side channel cannot bind {host}:{port} ({e}); is another engine using this "
                "port? Set prefill_url/decode_url ports apart"
            ) from e
        self.address = f"{host}:{port}"
        self._waiting: list[_Waiting] = []
        self._stop = threading.Event()
        self.malformed_frames = 0
        self._thread = threading.Thread(target=self._run, name="mooncake-side-channel", daemon=True)
        self._thread.start()

    def _poll_timeout_ms(self) -> int:
        """Sleep until the next thing that has a time: a waiting acquire's refusal or a lease's
        expiry (at most ``max_idle_s``, so ``close`` is seen). No periodic tick otherwise."""
        now = time.monotonic()
        until = [now + self._max_idle_s, *(w.until_s for w in self._waiting)]
        if (lease_deadline := self._leases.next_deadline_s()) is not None:
            until.append(lease_deadline)
        return max(1, int(1000 * (min(until) - now)) + 1)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._holds is not None:
            poller.register(self._holds, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._holds is not None and self._holds in events:
                    while self._holds.poll(0):
                        self._take_hold(self._holds.recv())
                if self._sock in events:
                    while self._sock.poll(0):
                        identity, payload = self._sock.recv_multipart()[:2]
                        self._handle(identity, payload)
                self._retry_waiting()
                self._leases.expire()
            except Exception:  # the engine must outlive any bad frame or peer
                logger.exception("side channel error (continuing)")
        self._sock.close()
        if self._holds is not None:
            self._holds.close()

    def _take_hold(self, payload: bytes) -> None:
        frame = decode_frame(payload)
        if isinstance(frame, Hold):
            self._on_hold(frame)

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            frame = decode_frame(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.malformed_frames += 1
            logger.warning("dropping malformed side-channel frame (%d bytes): %s", len(payload), e)
            return
        if isinstance(frame, Acquire):
            if not self._answer_acquire(identity, frame):
                self._waiting.append(
                    _Waiting(identity, frame, time.monotonic() + self._unknown_wait_s)
                )
        elif isinstance(frame, Release):
            self._leases.release(frame.transfer_id, "released" if frame.ok else "pull failed")
            self._send(identity, Released(frame.transfer_id))
        else:  # Hold included: holds come only from this engine's scheduler, over ipc
            logger.warning("dropping unexpected side-channel frame %s", type(frame).__name__)

    def _answer_acquire(self, identity: bytes, frame: Acquire) -> bool:
        got = self._leases.acquire(frame.transfer_id, frame.remote_block_ids)
        if got is None:
            return False
        if isinstance(got, Lease):
            segment, segments = self._layout()
            self._send(identity, Granted(frame.transfer_id, segment, segments))
            if _FREEZE_PREFIX and frame.transfer_id.startswith(_FREEZE_PREFIX):
                # Test hook: stop this process once the grant is (very likely) on the wire.
                threading.Timer(0.001, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        else:
            self._send(identity, Refused(frame.transfer_id, got))
        return True

    def _retry_waiting(self) -> None:
        now, still = time.monotonic(), []
        for w in self._waiting:
            if self._answer_acquire(w.identity, w.frame):
                continue
            if now >= w.until_s:
                reason = f"unknown transfer id {w.frame.transfer_id}"
                self._send(w.identity, Refused(w.frame.transfer_id, reason))
            else:
                still.append(w)
        self._waiting = still

    def _send(self, identity: bytes, frame: Frame) -> None:
        self._sock.send_multipart([identity, encode_frame(frame)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class SideChannelClient:
    """Request/reply to producers' side channels over DEALER sockets, reused across calls.

    Calls to one producer run concurrently: each call takes an idle socket to that producer (or
    opens one) and gives it back afterwards, so one slow acquire does not queue the others.
    Replies are matched by transfer id, so a late reply to a timed-out call is skipped.
    """

    def __init__(self) -> None:
        self._ctx = zmq.Context.instance()
        self._idle: dict[str, list[zmq.Socket]] = {}
        self._guard = threading.Lock()
        self._closed = False

    def _checkout(self, address: str) -> zmq.Socket:
        with self._guard:
            if self._closed:
                raise SideChannelError("side-channel client is closed")
            idle = self._idle.setdefault(address, [])
            if idle:
                return idle.pop()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        return sock

    def _checkin(self, address: str, sock: zmq.Socket) -> None:
        with self._guard:
            if self._closed:
                sock.close()
            else:
                self._idle.setdefault(address, []).append(sock)

    def call(self, address: str, frame: Acquire | Release, timeout_s: float) -> Frame:
        sock = self._checkout(address)
        try:
            sock.send(encode_frame(frame))
            deadline = time.monotonic() + timeout_s
            while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
                if not sock.poll(left_ms):
                    break
                try:
                    reply = decode_frame(sock.recv())
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    logger.warning("dropping malformed reply from %s: %s", address, e)
                    continue
                if getattr(reply, "transfer_id", None) == frame.transfer_id:
                    return reply
            raise SideChannelError(
                f"no answer from producer side channel {address} in {timeout_s:.1f}s"
            )
        finally:
            self._checkin(address, sock)

    def close(self) -> None:
        with self._guard:
            self._closed = True
            for socks in self._idle.values():
                for sock in socks:
                    sock.close()
            self._idle.clear()
