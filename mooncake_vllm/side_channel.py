"""The side channel between a consumer worker and the producer worker of the same TP rank.

ZeroMQ ROUTER on the producer, one DEALER per peer on the consumer; frames from ``protocol``.
The producer answers ``Acquire`` with the lease's memory layout (or a refusal) and ``Release`` with
``Released``. An ``Acquire`` for a transfer id the producer has not heard of yet (the handoff can
reach the consumer a step before the producer's worker learns of the lease) waits up to
``unknown_wait_s`` before it is refused.
"""

from __future__ import annotations

import logging
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
    MemSegment,
    Refused,
    Release,
    Released,
    decode_frame,
    encode_frame,
)

logger = logging.getLogger(__name__)


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
        unknown_wait_s: float = 5.0,
        tick_s: float = 0.01,
    ):
        self._leases = leases
        self._layout = layout
        self._unknown_wait_s = unknown_wait_s
        self._tick_ms = int(tick_s * 1000)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
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

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(self._tick_ms):
                    identity, payload = self._sock.recv_multipart()[:2]
                    self._handle(identity, payload)
                self._retry_waiting()
                self._leases.expire()
            except Exception:  # the engine must outlive any bad frame or peer
                logger.exception("side channel error (continuing)")
        self._sock.close()

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
        else:
            logger.warning("dropping unexpected side-channel frame %s", type(frame).__name__)

    def _answer_acquire(self, identity: bytes, frame: Acquire) -> bool:
        got = self._leases.acquire(frame.transfer_id, frame.remote_block_ids)
        if got is None:
            return False
        if isinstance(got, Lease):
            segment, segments = self._layout()
            self._send(identity, Granted(frame.transfer_id, segment, segments))
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
