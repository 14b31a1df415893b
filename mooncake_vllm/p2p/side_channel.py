"""The side channel between a consumer worker and the producer engine, one per producer TP rank.

ZeroMQ ROUTER on the producer (served by its lease server process, see ``leases.process``), one
DEALER per peer on the consumer; frames from ``protocol``, sealed with the shared secret when one
is configured (``auth``). The producer answers ``Acquire`` with the rank's memory layout (or a
refusal) and ``Release`` with ``Released``. A lease exists before its handoff leaves the producer,
so an unknown transfer id is refused at once.

Nothing a peer sends can hurt another peer's requests: a frame that does not verify, is too big,
comes too fast or from one peer too many is dropped and counted (``PeerGuard``), and the log says
so at most once per ``_DROP_LOG_INTERVAL_S`` with the counts; a ``Release`` is honoured only from
the peer that acquired the lease (``leases.table``), and one of an id never held is counted as
dropped too (so a flood of them makes the lease server rest, ``abuse_pause_s``). Parked pending
acquires are bounded per peer and in all (``_MAX_WAITING_PER_PEER``, ``_MAX_WAITING``).

A sealed request names the side channel it is sent to (``channel_context``: its rank's port), so
a request captured on one rank's channel does not verify on a sibling rank's, whose replay guard
has never seen it. The producer's incarnation is covered where the consumer knows it: an
``Acquire`` names it in its (sealed) body and is refused when it differs; ``Release`` and
``Await`` carry an owner token that exists only in the incarnation that granted it; a pending
acquire precedes its grant and cannot know it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from mooncake_vllm.core.auth import (
    REPLY,
    REQUEST,
    AuthError,
    Keys,
    ReplayGuard,
    open_frame,
    seal_frame,
)
from mooncake_vllm.core.auth import short_id as short
from mooncake_vllm.core.os_threads import latency_critical_section, latency_zmq_context
from mooncake_vllm.p2p.leases.table import NOT_YET, Lease, LeaseTable, NotOwner
from mooncake_vllm.p2p.protocol import (
    ALL_LAYERS,
    Acquire,
    Await,
    Frame,
    Granted,
    Handoff,
    MemSegment,
    Progress,
    Refused,
    Release,
    Released,
    decode_frame,
    encode_frame,
)

logger = logging.getLogger(__name__)

# Dropped frames are logged at most this often, with the counts since the last line.
_DROP_LOG_INTERVAL_S = 10.0
# Messages ZeroMQ queues per peer before it stops reading that peer's connection.
_PEER_QUEUE = 64
# A peer silent this long leaves the guard's table.
_PEER_IDLE_S = 60.0
# Pending acquires (``--dispatch concurrent``) parked until their lease exists: at most this many
# per side channel, at most ``_MAX_WAITING_PER_PEER`` of one peer (a consumer's client has one
# call in flight per socket, so a real peer parks one), each for at most this long.
_MAX_WAITING = 1024
_MAX_WAITING_PER_PEER = 64
_MAX_WAIT_S = 600.0
# How often a waiting pending acquire looks whether its request was cancelled.
_CANCEL_CHECK_S = 0.1
# Abuse duty cycle (``abuse_pause_s``).
_ABUSE_MIN_FRAMES = 64
_ABUSE_MAX_PAUSE_S = 0.01
# Idle sockets a consumer's client keeps, over all producers (``SideChannelClient``).
MAX_IDLE_SOCKETS = 64


class SideChannelError(RuntimeError):
    pass


def channel_context(port: int) -> bytes:
    """What a request's seal binds it to (``auth.seal_frame``'s context): the side channel of one
    producer rank, by its port (the handoff and ``/query`` advertise the ports the producer
    binds, and the consumer dials them as given)."""
    return b"side-channel port %d" % port


def seal_request(keys: Keys, frame: Frame, address: str) -> tuple[bytes, bytes]:
    """``(bytes, nonce)``: ``frame`` sealed for the side channel at ``address`` (``host:port``)."""
    port = int(address.rsplit(":", 1)[1])
    return seal_frame(keys, encode_frame(frame), REQUEST, channel_context(port))


class CallCancelled(SideChannelError):
    """A call given up on request (its request was aborted)."""


class PeerGuard:
    """Bounds what side-channel peers can make the producer do: per-peer frame rate (a token
    bucket with a burst of two seconds' worth), at most ``max_peers`` peers tracked (the least
    recently heard goes first, so a flood of new sockets cannot lock a real consumer out), and
    the counts of what was dropped, by reason. Pure: the clock is injected."""

    def __init__(
        self,
        rate_per_s: float,
        max_peers: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        # At least one frame: below 0.5 frames/s two seconds' worth is less than one, and a
        # bucket that never holds a whole token would refuse every frame forever.
        self._rate, self._burst = rate_per_s, max(1.0, 2 * rate_per_s)
        self._max_peers = max_peers
        self._clock = clock
        self._peers: OrderedDict[bytes, list[float]] = OrderedDict()  # id -> [tokens, at]
        self.dropped: Counter[str] = Counter()

    def admit(self, identity: bytes) -> bool:
        now = self._clock()
        bucket = self._peers.pop(identity, None)
        if bucket is None:
            bucket = [self._burst, now]
            while len(self._peers) >= self._max_peers:
                self._peers.popitem(last=False)
                self.dropped["peers evicted"] += 1
        tokens = min(self._burst, bucket[0] + (now - bucket[1]) * self._rate)
        self._peers[identity] = bucket  # most recently heard last
        if tokens < 1:
            bucket[:] = [tokens, now]
            self.dropped["rate limited"] += 1
            return False
        bucket[:] = [tokens - 1, now]
        return True

    def forget_idle(self) -> None:
        cutoff = self._clock() - _PEER_IDLE_S
        while self._peers and next(iter(self._peers.values()))[1] < cutoff:
            self._peers.popitem(last=False)

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    def dropped_total(self) -> int:
        """Frames dropped since the last ``take_dropped``."""
        return self.dropped.total() - self.dropped["peers evicted"]

    def take_dropped(self) -> dict[str, int]:
        out, self.dropped = dict(self.dropped), Counter()
        out.pop("peers evicted", None)  # not a dropped frame
        return out


def abuse_pause_s(frames: int, dropped: int, busy_s: float) -> float:
    """How long the lease server's loop rests after a batch, so that junk cannot keep it busy
    (it runs at a raised priority, beside vLLM's engines): after a batch of at least
    ``_ABUSE_MIN_FRAMES`` frames, most of them dropped, three times the batch's own time, at most
    ``_ABUSE_MAX_PAUSE_S``. Under a flood the loop then works about a quarter of the time; real
    frames are fair-queued with the junk by ZeroMQ and wait at most one pause, and the junk
    backs up into its senders' sockets."""
    if frames < _ABUSE_MIN_FRAMES or 2 * dropped <= frames:
        return 0.0
    return min(_ABUSE_MAX_PAUSE_S, 3 * busy_s)


class SideChannelServer:
    """Serves one producer TP rank's leases on a ROUTER socket. It has no thread of its own: the
    lease server's loop (``leases.process``) polls ``sock`` and calls ``serve_ready``.

    ``on_unknown``: called before an unknown transfer id is refused, to take in holds the engine
    core has sent but the loop has not read yet (a hold is sent before its handoff leaves).
    ``on_release``: called after a release, before the consumer hears of it.
    ``on_grant``: called with the transfer id right before a ``Granted`` is sent.

    A pending acquire (``Acquire.wait_ms``: a pending handoff's, sent while the prefill still
    computes) of an id not held yet is parked, bounded in number and time, and answered by
    ``answer_waiting`` once the hold arrives, or refused at its deadline. Likewise an ``Await``
    (the owner of a grant given while the prefill computes, ``layerwise_handoff``) is parked
    until more layers are ready, the prefill has finished or failed, or its time is up."""

    def __init__(
        self,
        host: str,
        port: int,
        leases: LeaseTable,
        layout: Callable[[], tuple[str, list[MemSegment], list[str]]],
        *,
        context: zmq.Context,
        keys: Keys = (),
        incarnation: str = "",
        guard: PeerGuard | None = None,
        max_frame_bytes: int = 1 << 20,
        on_grant: Callable[[str], None] | None = None,
        on_unknown: Callable[[], None] = lambda: None,
        on_release: Callable[[], None] = lambda: None,
    ):
        self._leases = leases
        self._layout = layout
        self._keys = keys
        self._incarnation = incarnation
        self._replays = ReplayGuard()
        self.guard = guard if guard is not None else PeerGuard(2000.0, 256)
        self._on_grant = on_grant
        self._on_unknown = on_unknown
        self._on_release = on_release
        self.sock = context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # ZeroMQ itself disconnects a peer whose message is larger, and stops reading a peer's
        # connection once this many of its messages wait.
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.sock.setsockopt(zmq.RCVHWM, _PEER_QUEUE)
        try:
            self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self.sock.close()
            raise SideChannelError(
                f"side channel cannot bind {host}:{port} ({e}); is another engine using this "
                "port? Set prefill_url/decode_url ports apart"
            ) from e
        self.address = f"{host}:{port}"
        self._context = channel_context(port)
        self._waiting: dict[str, list[_Waiting]] = {}
        self._awaits: dict[str, list[_Waiting]] = {}
        self._parked_by: Counter[bytes] = Counter()  # peer identity -> its parked waits
        self._clock = time.monotonic

    def serve_ready(self, max_frames: int = 256) -> tuple[int, int]:
        """Answers up to ``max_frames`` of the frames that have arrived (the loop's other duties,
        lease expiry among them, come between batches); never blocks. Returns the frames read
        and how many of them were dropped (junk, rate-limited, refused as unknown)."""
        dropped0 = self.guard.dropped_total()
        frames = 0
        while frames < max_frames and self.sock.poll(0):
            frames += 1
            parts = self.sock.recv_multipart(copy=True)
            if len(parts) != 2:  # a DEALER sends one part; the ROUTER adds the identity
                self.guard.drop("malformed")
                continue
            identity, payload = parts
            if self.guard.admit(identity):
                self._handle(identity, payload)
        return frames, self.guard.dropped_total() - dropped0

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            body, time_ms, nonce = open_frame(self._keys, payload, REQUEST, self._context)
            if self._keys:
                self._replays.check(time_ms, nonce)
            frame = decode_frame(body)
        except AuthError as e:
            self.guard.drop(str(e))
            return
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.guard.drop("malformed")
            return
        if isinstance(frame, Acquire):
            self._answer_acquire(identity, nonce, frame)
        elif isinstance(frame, Await):
            self._answer_await(_Waiting(identity, nonce, frame, self._wait_deadline(frame)))
        elif isinstance(frame, Release):
            if self._unpark(frame):
                self._send(identity, nonce, Released(frame.transfer_id))
                return
            try:
                live = self._leases.release(frame.transfer_id, frame.owner, frame.ok)
            except NotOwner:
                self.guard.drop("release by a non-owner")
                return
            if not live and self._leases.ended_reason(frame.transfer_id) is None:
                # Never held here (or long forgotten): answered, since a consumer may wait for
                # it, but counted, so that a flood of them makes the loop rest.
                self.guard.drop("release of an unknown transfer id")
            self._on_release()
            self._send(identity, nonce, Released(frame.transfer_id))
        else:
            self.guard.drop("unexpected frame")

    def _acquire(self, frame: Acquire, pending: bool = False) -> Lease | str | object | None:
        """The table's answer to ``frame``; an unknown id only once the holds the engine core
        has sent are taken in (``on_unknown``)."""
        args = (frame.transfer_id, frame.remote_block_ids, frame.owner, frame.readers)
        kwargs = {
            "pending": pending,
            "layers_ok": frame.layers_ok,
            "prompt_digest": frame.prompt_digest,
        }
        got = self._leases.acquire(*args, **kwargs)
        if got is None:
            self._on_unknown()
            got = self._leases.acquire(*args, **kwargs)
        return got

    def _answer_acquire(self, identity: bytes, nonce: bytes, frame: Acquire) -> None:
        if frame.wait_ms > 0 and not frame.remote_block_ids and not frame.incarnation:
            self._answer_pending(_Waiting(identity, nonce, frame, self._wait_deadline(frame)))
            return
        if frame.incarnation != self._incarnation:
            reason = (
                f"the producer restarted: this is incarnation {self._incarnation or '-'}, the "
                f"handoff is from {frame.incarnation or '-'}"
            )
            self._send(identity, nonce, Refused(frame.transfer_id, reason))
            return
        got = self._acquire(frame)
        if isinstance(got, Lease):
            self._grant(identity, nonce, frame)
        elif got is NOT_YET:  # a handoff leaves only once its prefill has finished
            reason = f"the prefill of transfer {short(frame.transfer_id)} has not finished"
            self._send(identity, nonce, Refused(frame.transfer_id, reason))
        else:
            if got is None:
                self.guard.drop("unknown transfer id")
            reason = got or f"unknown transfer id {short(frame.transfer_id)}"
            self._send(identity, nonce, Refused(frame.transfer_id, reason))

    def _grant(
        self,
        identity: bytes,
        nonce: bytes,
        frame: Acquire,
        handoff: Handoff | None = None,
        ready: int = ALL_LAYERS,
    ) -> None:
        """``Granted``; to a pending acquire with the lease's ``handoff`` and ready layers."""
        segment, segments, layers = self._layout()
        if self._on_grant is not None:
            self._on_grant(frame.transfer_id)
        granted = Granted(
            frame.transfer_id, segment, segments, self._incarnation, handoff, ready, layers
        )
        self._send(identity, nonce, granted)

    def _wait_deadline(self, frame: Acquire | Await) -> float:
        return self._clock() + min(frame.wait_ms / 1000, _MAX_WAIT_S)

    def _parked(self) -> int:
        return self._parked_by.total()

    def _park(self, table: dict[str, list[_Waiting]], w: _Waiting, new: bool) -> None:
        """Parks ``w``; a new one only while its peer has fewer than ``_MAX_WAITING_PER_PEER``
        parked, and while fewer than ``_MAX_WAITING`` are parked in all or a peer holding more
        than one more than ``w``'s peer gives up its latest (so peers that each open many sockets
        still cannot lock out a consumer's one pending acquire). Refusals are counted."""
        tid = w.frame.transfer_id
        if new and self._parked_by[w.identity] >= _MAX_WAITING_PER_PEER:
            self.guard.drop("too many pending acquires from one peer")
            reason = f"this peer has {_MAX_WAITING_PER_PEER} acquires waiting here already"
            self._send(w.identity, w.nonce, Refused(tid, reason))
            return
        if new and self._parked() >= _MAX_WAITING and not self._make_room(w.identity):
            self.guard.drop("too many pending acquires")
            reason = f"{_MAX_WAITING} acquires already wait for their prefills here"
            self._send(w.identity, w.nonce, Refused(tid, reason))
            return
        table.setdefault(tid, []).append(w)
        self._parked_by[w.identity] += 1

    def _make_room(self, identity: bytes) -> bool:
        """Refuses the parked wait of the peer with the most parked that would wait longest, if
        that peer holds at least two more than ``identity``; True if one was refused."""
        biggest, count = self._parked_by.most_common(1)[0]
        if count < self._parked_by[identity] + 2:
            return False
        tables = (self._waiting, self._awaits)
        _, table, w = max(
            (
                (w.deadline_s, t, w)
                for t in tables
                for ws in t.values()
                for w in ws
                if w.identity == biggest
            ),
            key=lambda x: x[0],
        )
        self._unlist(table, w)
        self.guard.drop("too many pending acquires from one peer")
        reason = f"{_MAX_WAITING} acquires wait here, most of them this peer's"
        self._send(w.identity, w.nonce, Refused(w.frame.transfer_id, reason))
        return True

    def _unlist(self, table: dict[str, list[_Waiting]], w: _Waiting) -> None:
        """Takes the parked ``w`` out of ``table`` and of its peer's count."""
        ws = table[w.frame.transfer_id]
        ws.remove(w)
        if not ws:
            del table[w.frame.transfer_id]
        self._unpark_count([w])

    def _unpark_count(self, ws: list[_Waiting]) -> None:
        for w in ws:
            self._parked_by[w.identity] -= 1
            if self._parked_by[w.identity] <= 0:
                del self._parked_by[w.identity]

    def _answer_pending(self, w: _Waiting, new: bool = True) -> None:
        tid = w.frame.transfer_id
        got = self._acquire(w.frame, pending=True)
        if isinstance(got, Lease):
            self._grant(w.identity, w.nonce, w.frame, got.handoff, got.ready)
        elif isinstance(got, str):
            self._send(w.identity, w.nonce, Refused(tid, got))
        elif w.deadline_s <= self._clock():
            if got is None:  # never held: a made-up id, or a prefill that never came
                self.guard.drop("pending acquire of an id never held")
            waited = w.frame.wait_ms / 1000
            reason = f"no prefill held transfer {short(tid)} within {waited:.1f}s"
            self._send(w.identity, w.nonce, Refused(tid, reason))
        else:  # unknown yet, or held while computing by an acquire that waits for the end
            self._park(self._waiting, w, new)

    def _answer_await(self, w: _Waiting, new: bool = True) -> None:
        tid, frame = w.frame.transfer_id, w.frame
        got = self._leases.progress(tid, frame.owner)
        if isinstance(got, str):
            self._send(w.identity, w.nonce, Refused(tid, got))
        elif got != frame.known or w.deadline_s <= self._clock():
            self._send(w.identity, w.nonce, Progress(tid, got))
        else:
            self._park(self._awaits, w, new)

    def answer_waiting(self) -> None:
        """Answers the parked pending acquires whose lease now exists (or has ended) and the
        parked awaits whose layers moved on, and those past their deadline; called by the loop
        after it has read the engine core's holds and the workers' layer marks."""
        now = self._clock()
        for tid in list(self._waiting):
            live = self._leases.is_live(tid) or self._leases.ended_reason(tid) is not None
            if live or any(w.deadline_s <= now for w in self._waiting[tid]):
                ws = self._waiting.pop(tid)
                self._unpark_count(ws)
                for w in ws:
                    self._answer_pending(w, new=False)  # a grant, a reason, or parked again
        for tid in list(self._awaits):
            ws = self._awaits.pop(tid)
            self._unpark_count(ws)
            for w in ws:
                self._answer_await(w, new=False)

    def _unpark(self, frame: Release) -> bool:
        """A release by the owner of a parked pending acquire withdraws it (its request was
        aborted before the prefill finished); a parked await of the owner goes with it."""
        for w in [
            w for w in self._awaits.get(frame.transfer_id, []) if w.frame.owner == frame.owner
        ]:
            self._unlist(self._awaits, w)
        for w in self._waiting.get(frame.transfer_id, []):
            if w.frame.owner == frame.owner:
                self._unlist(self._waiting, w)
                return True
        return False

    def next_deadline_s(self) -> float | None:
        """When the first parked acquire or await runs out (None: none is parked)."""
        parked = [*self._waiting.values(), *self._awaits.values()]
        return min((w.deadline_s for ws in parked for w in ws), default=None)

    def _send(self, identity: bytes, nonce: bytes, frame: Frame) -> None:
        sealed, _ = seal_frame(self._keys, encode_frame(frame), REPLY, nonce)
        try:
            self.sock.send_multipart([identity, sealed], zmq.NOBLOCK)
        except zmq.Again:  # the peer does not read its replies: its problem, not the loop's
            self.guard.drop("peer not reading")

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True)
class _Waiting:
    """A parked pending acquire and where its answer goes."""

    identity: bytes
    nonce: bytes
    frame: Acquire | Await
    deadline_s: float


class SideChannelClient:
    """Request/reply to producers' side channels over DEALER sockets, reused across calls.

    Calls to one producer run concurrently: each call takes an idle socket to that producer (or
    opens one) and gives it back afterwards, so one slow acquire does not queue the others.
    Replies are matched by transfer id, so a late reply to a timed-out call is skipped.

    At most ``max_idle_sockets`` idle sockets are kept, over all producers: the least recently
    used goes (closed) first, so a consumer that has met many producers does not keep a
    connection, and ZeroMQ's reconnects, to each of them for ever.
    """

    def __init__(self, keys: Keys = (), max_idle_sockets: int = MAX_IDLE_SOCKETS) -> None:
        self._keys = keys
        self.rejected = 0  # replies dropped: malformed or not verifying (under _lock)
        # Per socket: nonces of calls that timed out, whose late replies are skipped uncounted.
        self._late: defaultdict[zmq.Socket, deque[bytes]] = defaultdict(lambda: deque(maxlen=8))
        self._ctx = latency_zmq_context()
        # Idle sockets, least recently checked in first.
        self._idle: OrderedDict[zmq.Socket, str] = OrderedDict()
        self._max_idle = max_idle_sockets
        self._lock = threading.Lock()
        self._closed = False

    def _checkout(self, address: str) -> zmq.Socket:
        with self._lock:
            if self._closed:
                raise SideChannelError("side-channel client is closed")
            for sock in reversed(self._idle):  # the most recently used first
                if self._idle[sock] == address:
                    del self._idle[sock]
                    return sock
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address}")
        return sock

    def _checkin(self, address: str, sock: zmq.Socket) -> None:
        with self._lock:
            if self._closed:
                self._close_socket(sock)
                return
            self._idle[sock] = address
            while len(self._idle) > self._max_idle:
                self._close_socket(self._idle.popitem(last=False)[0])

    def _close_socket(self, sock: zmq.Socket) -> None:
        """Under the lock: ``sock`` is nobody's any more."""
        self._late.pop(sock, None)
        sock.close()

    def call(
        self,
        address: str,
        frame: Acquire | Await | Release,
        timeout_s: float,
        cancelled: threading.Event | None = None,
    ) -> Frame:
        """The reply to ``frame``. ``cancelled``: checked every ``_CANCEL_CHECK_S`` while
        waiting (a pending acquire waits for a prefill: its request may be aborted meanwhile);
        raises ``CallCancelled`` once set."""
        sock = self._checkout(address)
        try:
            with latency_critical_section():
                sealed, nonce = seal_request(self._keys, frame, address)
                sock.send(sealed)
                deadline = time.monotonic() + timeout_s
                while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
                    if cancelled is not None:
                        if cancelled.is_set():
                            self._late[sock].append(nonce)
                            raise CallCancelled(f"call to {address} cancelled")
                        left_ms = min(left_ms, int(_CANCEL_CHECK_S * 1000))
                    if not sock.poll(left_ms):
                        continue
                    reply = self._open(address, sock, sock.recv(), nonce)
                    if getattr(reply, "transfer_id", None) == frame.transfer_id:
                        return reply
                self._late[sock].append(nonce)  # its reply may still come on this socket
                self._withdraw(sock, frame, address)
                raise SideChannelError(
                    f"no answer from producer side channel {address} in {timeout_s:.1f}s"
                )
        finally:
            self._checkin(address, sock)

    def _withdraw(self, sock: zmq.Socket, frame: Acquire | Await | Release, address: str) -> None:
        """After an ``Acquire`` with blocks went unanswered, a ``Release`` (``ok`` false) of
        its owner token behind it on the same socket, not waited for.

        Across a cut link the acquire sits in this socket's TCP send queue and reaches the
        producer when the link returns, after this consumer gave up: the producer would grant
        it and hold the blocks for a reader that is gone, until its pull hold ends (its
        ``load_timeout_s`` + ``stall_timeout_s`` + 5 s). One connection keeps the order, so the
        release arrives right after the acquire and ends the lease at once; if the acquire was
        refused or the lease has ended, the release changes nothing. A pending acquire (no
        blocks yet) is not withdrawn: the producer parks it and ends it by its own wait."""
        if not isinstance(frame, Acquire) or frame.wait_ms:
            return
        release = Release(frame.transfer_id, ok=False, owner=frame.owner)
        sealed, nonce = seal_request(self._keys, release, address)
        with contextlib.suppress(zmq.ZMQError):  # a full queue: the pull hold still bounds it
            sock.send(sealed, zmq.NOBLOCK)
            self._late[sock].append(nonce)

    def _open(self, address: str, sock: zmq.Socket, data: bytes, nonce: bytes) -> Frame | None:
        """The reply in ``data`` if it answers ``nonce``; None otherwise, counted in
        ``rejected`` unless it is the late answer to an earlier call on this socket."""
        try:
            return decode_frame(open_frame(self._keys, data, REPLY, nonce)[0])
        except AuthError as e:
            for late in self._late[sock]:  # sealed for a call that gave up waiting: skip it
                try:
                    open_frame(self._keys, data, REPLY, late)
                    return None
                except AuthError:
                    continue
            logger.debug("dropping a reply from %s that does not verify (%s)", address, e)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("dropping malformed reply from %s: %s", address, e)
        with self._lock:
            self.rejected += 1
        return None

    def take_rejected(self) -> int:
        """Replies dropped since the last call (malformed, or not verifying)."""
        with self._lock:
            out, self.rejected = self.rejected, 0
            return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for sock in self._idle:
                self._close_socket(sock)
            self._idle.clear()
        # The context is not terminated: a call in flight may still hold a socket. One client
        # lives as long as its worker process.
