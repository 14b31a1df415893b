"""The side channel between a consumer worker and the producer engine, one per producer TP rank.

ZeroMQ ROUTER on the producer (served from its engine-core process, see ``lease_service``), one
DEALER per peer on the consumer; frames from ``protocol``. The producer answers ``Acquire`` with
the rank's memory layout (or a refusal) and ``Release`` with ``Released``. A lease exists before
its handoff leaves the producer, so an unknown transfer id is refused at once. The thread sleeps
in ``poll`` until a frame arrives or a lease expires: no periodic tick.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from mooncake_vllm.leases import Lease, LeaseTable
from mooncake_vllm.os_threads import (
    latency_critical_section,
    latency_zmq_context,
    make_latency_critical,
    name_this_thread,
)
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

# A failing server loop logs at most this often (with the count), pausing between attempts.
_ERROR_LOG_INTERVAL_S = 60.0
_ERROR_PAUSE_S = 0.1
# Measured (perf sched, 1900-token prompts at c=4 on 2 cores): at nice 0 the server thread waited
# 11.7 ms on average and up to 168 ms for a CPU after each wake-up; at nice -10, 1.2 ms and 32 ms.
# Real-time priority where allowed (see os_threads), this nice value otherwise.
_SIDE_CHANNEL_NICE = -10


class SideChannelError(RuntimeError):
    pass


class SideChannelServer:
    """Serves one producer TP rank's leases; runs in its own thread until ``close``."""

    def __init__(
        self,
        host: str,
        port: int,
        leases: LeaseTable,
        layout: Callable[[], tuple[str, list[MemSegment]]],
        max_idle_s: float = 1.0,
        on_grant: Callable[[str], None] | None = None,
    ):
        self._leases = leases
        self._layout = layout
        self._on_grant = on_grant
        self._max_idle_s = max_idle_s
        self._ctx = latency_zmq_context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise SideChannelError(
                f"side channel cannot bind {host}:{port} ({e}); is another engine using this "
                "port? Set prefill_url/decode_url ports apart"
            ) from e
        self.address = f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mooncake-side-channel", daemon=True)
        self._thread.start()

    def _poll_timeout_ms(self) -> int:
        """Sleep until a frame arrives or the next lease expires (at most ``max_idle_s``, so
        ``close`` is seen). No periodic tick otherwise."""
        now = time.monotonic()
        until = now + self._max_idle_s
        if (lease_deadline := self._leases.next_deadline_s()) is not None:
            until = min(until, lease_deadline)
        return max(1, int(1000 * (until - now)) + 1)

    def _run(self) -> None:
        name_this_thread("mc-sidechannel")
        priority = make_latency_critical(_SIDE_CHANNEL_NICE)
        logger.debug("side channel %s thread priority: %s", self.address, priority)
        errors, logged_at = 0, -math.inf  # consecutive errors; when the last was logged
        while not self._stop.is_set():
            try:
                if self._sock.poll(self._poll_timeout_ms()):
                    while self._sock.poll(0):
                        identity, payload = self._sock.recv_multipart()[:2]
                        self._handle(identity, payload)
                self._leases.expire()
                if errors:
                    logger.info("side channel %s recovered after %d errors", self.address, errors)
                errors = 0
            except Exception:  # the engine must outlive any bad frame or peer
                errors += 1
                if time.monotonic() - logged_at >= _ERROR_LOG_INTERVAL_S:
                    logged_at = time.monotonic()
                    logger.exception("side channel %s error (%d in a row; continuing)",
                                     self.address, errors)  # fmt: skip
                self._stop.wait(_ERROR_PAUSE_S)  # a persistent error must not spin
        self._sock.close()
        self._ctx.term()

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            frame = decode_frame(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("dropping malformed side-channel frame (%d bytes): %s", len(payload), e)
            return
        if isinstance(frame, Acquire):
            self._answer_acquire(identity, frame)
        elif isinstance(frame, Release):
            self._leases.release(frame.transfer_id, frame.ok)
            self._send(identity, Released(frame.transfer_id))
        else:
            logger.warning("dropping unexpected side-channel frame %s", type(frame).__name__)

    def _answer_acquire(self, identity: bytes, frame: Acquire) -> None:
        got = self._leases.acquire(frame.transfer_id, frame.remote_block_ids, frame.readers)
        if isinstance(got, Lease):
            segment, segments = self._layout()
            if self._on_grant is not None:
                self._on_grant(frame.transfer_id)
            self._send(identity, Granted(frame.transfer_id, segment, segments))
        else:
            reason = got or f"unknown transfer id {frame.transfer_id}"
            self._send(identity, Refused(frame.transfer_id, reason))

    def _send(self, identity: bytes, frame: Frame) -> None:
        self._sock.send_multipart([identity, encode_frame(frame)])

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

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
        self._ctx = latency_zmq_context()
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
            with latency_critical_section():
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
        # The context is not terminated: a call in flight may still hold a socket. One client
        # lives as long as its worker process.
