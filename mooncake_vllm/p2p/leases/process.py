"""The producer's leases and side channels, in a small process of their own (the lease server).

Why a process: an acquire must be answered within a millisecond. In the engine-core process the
side-channel thread needed the GIL to wake, read and answer, and vLLM's scheduler thread holds it
(a forced hand-over comes only every 5 ms); the decode's acquire p99 there reached the 20–100 ms
buckets under load. Here the loop has a GIL, and (where allowed) a real-time priority, of its
own (docs/benchmarks.md, A/B runs).

The engine core (``leases.client``) starts it with ``python -m mooncake_vllm.p2p.leases.process FD
PID`` and speaks to it over a socket pair: ``Start``, ``Layouts``, ``Hold``, ``Abort`` and ``Stop``
in, ``Ready`` and ``Ended`` out. With ``layerwise_handoff`` the producer's workers also send it
``LayerDone`` (a local socket): a layer of the prompts finishing in this step is written. Ordering
is what keeps "an acquire never waits for a step" true: the engine core writes a ``Hold`` before the
handoff leaves its process, so by the time a consumer's ``Acquire`` arrives the hold is in this
process's socket buffer; the loop reads commands first, and again before it refuses an unknown id. A
lease's end is reported (``Ended``) before the consumer hears ``Released``, and the engine core
frees the blocks only once it reads that.

The process ends when the engine core closes the socket pair (or dies: end of file, and the
kernel's parent-death signal as a backstop); a SIGTERM or SIGINT while the engine core lives (a
signal to vLLM's whole process group) is logged and ignored, so held leases are served while the
engine drains.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import sys
import time
from collections import Counter
from multiprocessing.connection import Connection

import msgspec
import zmq

from mooncake_vllm.core.child_process import die_with_parent, outlive_group_signal
from mooncake_vllm.core.os_threads import (
    latency_zmq_context,
    make_latency_critical,
    name_this_thread,
    set_policy,
)
from mooncake_vllm.p2p.leases.table import LeaseTable
from mooncake_vllm.p2p.local_channels import WakeSender
from mooncake_vllm.p2p.protocol import Handoff, MemSegment
from mooncake_vllm.p2p.side_channel import (
    PeerGuard,
    SideChannelError,
    SideChannelServer,
    abuse_pause_s,
)

logger = logging.getLogger("mooncake_vllm.p2p.leases.process")

# A failing loop logs at most this often (with the count), pausing between attempts.
_ERROR_LOG_INTERVAL_S = 60.0
_ERROR_PAUSE_S = 0.1
# Dropped side-channel frames: reported to the engine core and logged at most this often.
_DROP_REPORT_INTERVAL_S = 1.0
_DROP_LOG_INTERVAL_S = 10.0


class RankLayout(msgspec.Struct, frozen=True):
    """Where one producer rank's blocks are: its transfer-engine segment and memory layout, and
    each segment's layer (a pipeline stage holds its own layers)."""

    te_segment: str
    segments: list[MemSegment]
    worker_pid: int
    layers: list[str] = []

    @property
    def bytes_per_block(self) -> int:
        return sum(s.block_len for s in self.segments)


# ---- engine core -> lease server --------------------------------------------------------------


class Start(msgspec.Struct, tag="start", frozen=True, kw_only=True):
    host: str
    ports: list[int]  # side channel of worker rank r (PP rank × TP size + TP rank)
    # One per rank, or one per pipeline stage shared by its TP ranks (a replicated MLA latent):
    # rank r's is table r // (len(ports) // tables).
    tables: int
    ttl_s: float
    budget_bytes: int
    pull_hold_s: float
    wake_endpoint: str  # the engine core's wake-up socket (``local_channels``)
    keys: list[bytes] = []  # the shared secret (``auth``); over the private socket pair only
    incarnation: str = ""  # this start of the producer (``Handoff.producer_incarnation``)
    thread_priority: str = "nice"  # ``os_threads`` policy
    max_frame_bytes: int = 1 << 20
    peer_rate: float = 2000.0
    max_peers: int = 256
    # ``layerwise_handoff``: where the workers' ``LayerDone`` arrive, and the token they carry
    # (handed to the workers in the step metadata, so no other local process can mark layers).
    layers_endpoint: str = ""
    layers_token: bytes = b""
    # Tracing on: each ended lease's reason by request id, for its span (``Ended.by_request``).
    lease_reasons: bool = False


class Layouts(msgspec.Struct, tag="layouts", frozen=True):
    ranks: list[RankLayout]


class Hold(msgspec.Struct, tag="hold", frozen=True):
    req_id: str
    transfer_id: str
    block_ids: list[int]
    table_bytes: list[int]  # the lease's bytes in table t
    max_readers: int = 1  # consumer ranks that may share the lease
    handoff: Handoff | None = None  # what a pending acquire of it is granted with
    # Opened in the prefill's last step, before its layers are written (``LeaseTable.add``); a
    # second ``Hold`` without it says the request has finished.
    computing: bool = False


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """The request of a hold opened computing finished without a handover."""

    req_id: str
    transfer_id: str


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


# ---- lease server -> engine core --------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", frozen=True):
    error: str = ""  # why it could not start (e.g. a side-channel port in use)


class Ended(msgspec.Struct, tag="ended", frozen=True):
    req_ids: list[list[str]]  # per table: requests whose lease ended there
    reasons: dict[str, int]  # leases ended in table 0, by reason
    by_request: dict[str, str] = {}  # request id -> why its lease ended in table 0


class Dropped(msgspec.Struct, tag="dropped", frozen=True):
    counts: dict[str, int]  # side-channel frames dropped since the last report, by reason


# ---- producer worker -> lease server ----------------------------------------------------------


class LayerDone(msgspec.Struct, frozen=True):
    """Worker ``rank`` has written ``layer`` (segment order) of these transfers' prompts."""

    token: bytes
    rank: int
    layer: int
    transfer_ids: list[str]


Command = Start | Layouts | Hold | Abort | Stop
Report = Ready | Ended | Dropped
_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
report_decoder = msgspec.msgpack.Decoder(Report)
layer_done_decoder = msgspec.msgpack.Decoder(LayerDone)


def encode(msg: Command | Report | LayerDone) -> bytes:
    return _encoder.encode(msg)


class LeaseServer:
    """The loop: sleeps in one ``poll`` over the socket pair and every rank's side channel until a
    message arrives or the next lease expires; no periodic tick."""

    def __init__(self, start: Start, conn: Connection):
        self._conn = conn
        self._stopping = False
        self._layouts: list[RankLayout] = []
        # A table shared by all ranks (an MLA latent): each layer is ready once every rank wrote it.
        marks_needed = max(1, len(start.ports) // start.tables)
        self._tables = [
            LeaseTable(
                start.ttl_s,
                start.budget_bytes,
                start.pull_hold_s,
                marks_needed=marks_needed,
                keep_reasons=start.lease_reasons,
            )
            for _ in range(start.tables)
        ]
        self._ctx = latency_zmq_context()
        self._servers: list[SideChannelServer] = []
        self._layers_token = start.layers_token
        self._marks: zmq.Socket | None = None
        try:
            if start.layers_endpoint:
                self._marks = self._ctx.socket(zmq.PULL)
                self._marks.setsockopt(zmq.LINGER, 0)
                try:
                    self._marks.bind(start.layers_endpoint)
                except zmq.ZMQError as e:
                    raise SideChannelError(
                        f"layer marks cannot bind {start.layers_endpoint} ({e}); is another "
                        "engine using these ports? Set prefill_url/decode_url ports apart"
                    ) from e
            for rank, port in enumerate(start.ports):
                self._servers.append(
                    SideChannelServer(
                        start.host,
                        port,
                        self._tables[rank // marks_needed],
                        layout=lambda r=rank: (
                            self._layouts[r].te_segment,
                            self._layouts[r].segments,
                            self._layouts[r].layers,
                        ),
                        context=self._ctx,
                        keys=tuple(start.keys),
                        incarnation=start.incarnation,
                        guard=PeerGuard(start.peer_rate, start.max_peers),
                        max_frame_bytes=start.max_frame_bytes,
                        on_unknown=self._read_commands,
                        on_release=self._report,
                    )
                )
        except BaseException:
            self._close()
            raise
        self._waker = WakeSender(start.wake_endpoint)
        self._dropped_at = self._logged_at = time.monotonic()
        self._unlogged: Counter[str] = Counter()  # dropped frames not logged yet, by reason

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._conn.fileno(), zmq.POLLIN)
        for srv in self._servers:
            poller.register(srv.sock, zmq.POLLIN)
        if self._marks is not None:
            poller.register(self._marks, zmq.POLLIN)
        errors, logged_at = 0, -math.inf  # consecutive errors; when the last was logged
        try:
            while not self._stopping:
                try:
                    poller.poll(self._poll_timeout_ms())
                    self._read_commands()  # first: a hold precedes its handoff's acquire
                    self._read_marks()  # and a computing hold precedes its layers' marks
                    t0, frames, dropped = time.monotonic(), 0, 0
                    for srv in self._servers:
                        f, d = srv.serve_ready()
                        frames, dropped = frames + f, dropped + d
                    pause_s = abuse_pause_s(frames, dropped, time.monotonic() - t0)
                    for table in self._tables:
                        table.expire()
                    for srv in self._servers:  # pending acquires whose hold came, or time ran out
                        srv.answer_waiting()
                    self._report()
                    self._report_dropped()
                    if errors:
                        logger.info("recovered after %d errors", errors)
                    errors = 0
                    if pause_s:
                        time.sleep(pause_s)
                except Exception:  # the engine must outlive any bad frame or peer
                    errors += 1
                    if time.monotonic() - logged_at >= _ERROR_LOG_INTERVAL_S:
                        logged_at = time.monotonic()
                        logger.exception("error (%d in a row; continuing)", errors)
                    time.sleep(_ERROR_PAUSE_S)  # a persistent error must not spin
        finally:
            self._close()

    def _poll_timeout_ms(self) -> int | None:
        deadlines = [d for t in self._tables if (d := t.next_deadline_s()) is not None]
        deadlines += [d for srv in self._servers if (d := srv.next_deadline_s()) is not None]
        if any(srv.guard.dropped for srv in self._servers):  # a report is due even if all is quiet
            deadlines.append(self._dropped_at + _DROP_REPORT_INTERVAL_S)
        if self._unlogged:
            deadlines.append(self._logged_at + _DROP_LOG_INTERVAL_S)
        if not deadlines:
            return None  # no lease can expire: sleep until a message
        return max(0, int(1000 * (min(deadlines) - time.monotonic())) + 1)

    def _read_commands(self) -> None:
        """Applies every command the engine core has sent; never blocks."""
        try:
            while not self._stopping and self._conn.poll(0):
                cmd = command_decoder.decode(self._conn.recv_bytes())
                if isinstance(cmd, Hold):
                    layers = len(self._layouts[0].segments) if self._layouts else 0
                    for table, nbytes in zip(self._tables, cmd.table_bytes, strict=True):
                        table.add(
                            cmd.req_id,
                            cmd.transfer_id,
                            cmd.block_ids,
                            nbytes,
                            cmd.max_readers,
                            cmd.handoff,
                            computing=cmd.computing,
                            layers=layers,
                        )
                elif isinstance(cmd, Abort):
                    for table in self._tables:
                        table.abort(cmd.req_id, cmd.transfer_id)
                elif isinstance(cmd, Layouts):
                    self._layouts = list(cmd.ranks)
                elif isinstance(cmd, Stop):
                    self._stopping = True
        except (EOFError, OSError):  # the engine core has gone
            self._stopping = True

    def _read_marks(self) -> None:
        """Applies the workers' ``LayerDone``; one without this start's token is dropped."""
        while self._marks is not None and self._marks.poll(0):
            data = self._marks.recv()
            try:
                done = layer_done_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._servers[0].guard.drop("malformed layer mark")
                continue
            if not hmac.compare_digest(done.token, self._layers_token):
                self._servers[0].guard.drop("layer mark without the token")
                continue
            table = self._tables[done.rank * len(self._tables) // len(self._servers)]
            for tid in done.transfer_ids:
                table.mark(tid, done.layer)

    def _report(self) -> None:
        """Tells the engine core which requests' leases have ended (their blocks can be freed)."""
        req_ids = [sorted(t.take_finished()) for t in self._tables]
        if not any(req_ids):
            return
        reasons = self._tables[0].take_ended_counts()
        by_request = self._tables[0].take_ended_reasons()
        try:
            self._conn.send_bytes(encode(Ended(req_ids, reasons, by_request)))
        except OSError:  # the engine core has gone: nothing is left to free
            self._stopping = True
            return
        self._waker.wake()

    def _report_dropped(self) -> None:
        """Dropped side-channel frames: their counts to the engine core (for ``/metrics``) at
        most every ``_DROP_REPORT_INTERVAL_S``, and one log line with the counts at most every
        ``_DROP_LOG_INTERVAL_S``: abuse never costs a line per frame."""
        now = time.monotonic()
        if now < self._dropped_at + _DROP_REPORT_INTERVAL_S:
            return
        self._dropped_at = now
        counts: Counter[str] = Counter()
        for srv in self._servers:
            counts.update(srv.guard.take_dropped())
            srv.guard.forget_idle()
        self._unlogged.update(counts)
        if counts:
            try:
                self._conn.send_bytes(encode(Dropped(dict(counts))))
            except OSError:
                self._stopping = True
        if self._unlogged and now >= self._logged_at + _DROP_LOG_INTERVAL_S:
            logger.warning(
                "dropped %d side-channel frames in the last %.0f s: %s",
                sum(self._unlogged.values()),
                now - self._logged_at,
                ", ".join(f"{n} {why}" for why, n in self._unlogged.most_common()),
            )
            self._unlogged, self._logged_at = Counter(), now

    def _close(self) -> None:
        for srv in self._servers:
            srv.close()
        if self._marks is not None:
            self._marks.close()
        if hasattr(self, "_waker"):
            self._waker.close()
        self._ctx.term()


def main() -> None:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    outlive_group_signal(
        parent_pid, logger, "serving the held leases until the engine core stops this process"
    )
    die_with_parent(parent_pid)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s [lease server] %(message)s"
    )
    name_this_thread("mc-leaseserver")
    conn = Connection(fd)
    start = command_decoder.decode(conn.recv_bytes())
    if not isinstance(start, Start):
        raise SystemExit(f"lease server: expected Start, got {type(start).__name__}")
    set_policy(start.thread_priority)
    priority = make_latency_critical()
    try:
        server = LeaseServer(start, conn)
    except SideChannelError as e:
        conn.send_bytes(encode(Ready(str(e))))
        return
    conn.send_bytes(encode(Ready()))
    logger.info(
        "serving side channels on ports %s (pid %d, priority %s)",
        start.ports,
        os.getpid(),
        priority,
    )
    server.run()


if __name__ == "__main__":
    main()
