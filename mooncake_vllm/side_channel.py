"""The side channel between a consumer worker and the producer engine, one per producer TP rank.

ZeroMQ ROUTER on the producer (served by its lease server process, see ``lease_server``), one
DEALER per peer on the consumer; frames from ``protocol``. The producer answers ``Acquire`` with
the rank's memory layout (or a refusal) and ``Release`` with ``Released``. A lease exists before
its handoff leaves the producer, so an unknown transfer id is refused at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from mooncake_vllm.leases import Lease, LeaseTable
from mooncake_vllm.os_threads import latency_critical_section, latency_zmq_context
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


class SideChannelServer:
    """Serves one producer TP rank's leases on a ROUTER socket. It has no thread of its own: the
    lease server's loop (``lease_server``) polls ``sock`` and calls ``serve_ready``.

    ``on_unknown``: called before an unknown transfer id is refused, to take in holds the engine
    core has sent but the loop has not read yet (a hold is sent before its handoff leaves).
    ``on_release``: called after a release, before the consumer hears of it."""

    def __init__(
        self,
        host: str,
        port: int,
        leases: LeaseTable,
        layout: Callable[[], tuple[str, list[MemSegment]]],
        *,
        context: zmq.Context,
        on_grant: Callable[[str], None] | None = None,
        on_unknown: Callable[[], None] = lambda: None,
        on_release: Callable[[], None] = lambda: None,
    ):
        self._leases = leases
        self._layout = layout
        self._on_grant = on_grant
        self._on_unknown = on_unknown
        self._on_release = on_release
        self.sock = context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self.sock.close()
            raise SideChannelError(
                f"side channel cannot bind {host}:{port} ({e}); is another engine using this "
                "port? Set prefill_url/decode_url ports apart"
            ) from e
        self.address = f"{host}:{port}"

    def serve_ready(self) -> None:
        """Answers every frame that has arrived; never blocks."""
        while self.sock.poll(0):
            identity, payload = self.sock.recv_multipart()[:2]
            self._handle(identity, payload)

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
            self._on_release()
            self._send(identity, Released(frame.transfer_id))
        else:
            logger.warning("dropping unexpected side-channel frame %s", type(frame).__name__)

    def _acquire(self, frame: Acquire) -> Lease | str | None:
        return self._leases.acquire(frame.transfer_id, frame.remote_block_ids, frame.readers)

    def _answer_acquire(self, identity: bytes, frame: Acquire) -> None:
        got = self._acquire(frame)
        if got is None:
            self._on_unknown()
            got = self._acquire(frame)
        if isinstance(got, Lease):
            segment, segments = self._layout()
            if self._on_grant is not None:
                self._on_grant(frame.transfer_id)
            self._send(identity, Granted(frame.transfer_id, segment, segments))
        else:
            reason = got or f"unknown transfer id {frame.transfer_id}"
            self._send(identity, Refused(frame.transfer_id, reason))

    def _send(self, identity: bytes, frame: Frame) -> None:
        self.sock.send_multipart([identity, encode_frame(frame)])

    def close(self) -> None:
        self.sock.close()


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
