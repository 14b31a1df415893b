"""The proxy's subscription to each engine's KV events (``--kv-events URL=tcp://HOST:PORT``).

A vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:PORT"}'`` publishes on a ZMQ PUB socket, per step, a multipart message
``(topic, seq, payload)``: ``seq`` an 8-byte big-endian counter from 0, ``payload`` a msgpack
``KVEventBatch`` ``[ts, events, dp_rank]`` whose events are maps tagged ``type``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). We decode the msgpack without
vLLM's types (the proxy does not import vLLM) and hand each event to ``kv_index.KvIndex``.

What we did not hear cannot be trusted: a gap in ``seq`` (the publisher's high-water mark
dropped batches) or a ``seq`` going back (the engine restarted) clears that engine's part of
the index, so a lost ``BlockRemoved`` never leaves a block the engine no longer holds. Blocks
stored before the proxy subscribed are simply unknown (the engine is not chosen for them
until they are stored or hit again: vLLM reports a prefix-cache hit as a ``BlockStored`` too).

What we cannot read is dropped, counted (``StreamState.dropped`` and, with metrics,
``mooncake_proxy_kv_events_dropped{backend, reason}``) and never ends the subscription:

- ``unreadable``: a message that is not ``(topic, 8-byte seq, msgpack batch)``; its events
  are lost, so the engine's part is cleared, as on a gap;
- ``invalid``: one event of a known type with wrong fields (``kv_index.BadEvent``): skipped,
  the engine's part cleared (what it said is lost), the batch's other events applied;
- ``unknown_type``: an event type this proxy does not know (a newer vLLM's): skipped;
- ``failed``: applying an event raised (a bug of ours): logged with its traceback, cleared;
- ``disconnected``: the connection was lost (the engine stopped, or sent a message over
  ``MAX_MESSAGE_BYTES``, which ZMQ refuses to read: ``MAXMSGSIZE``); what it sent meanwhile
  is lost, so the engine's part is cleared and a new socket subscribes after
  ``RESTART_DELAY_S``.

At most ``RCVHWM`` messages wait per engine, so one engine's backlog is bounded by
``RCVHWM * MAX_MESSAGE_BYTES``. Should a subscription end with an error (a ZMQ error), it is
logged with its traceback and started again the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from mooncake_vllm.proxy.health import stop_task
from mooncake_vllm.proxy.kv_index import BadEvent, KvIndex, decode_event
from mooncake_vllm.proxy.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

# One published batch, at most. A step's batch holds the blocks it stored, each as its token
# ids and hash (~5 + 34 B per token at block size 16): a 128k-token prompt's is under 1 MiB.
MAX_MESSAGE_BYTES = 16 << 20
# Messages waiting per engine, at most (ZMQ's default is 1000: 16 GiB of the largest).
RCVHWM = 16
# How long a subscription that ended waits before it starts again.
RESTART_DELAY_S = 1.0
DROP_REASONS = ("unreadable", "invalid", "unknown_type", "failed", "disconnected")


class _Batch(msgspec.Struct, array_like=True):
    """vLLM's ``KVEventBatch``; each event is decoded on its own (``kv_index.decode_event``),
    so one bad event costs only itself."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


@dataclass
class StreamState:
    """What one engine's event stream has delivered."""

    batches: int = 0
    events: int = 0
    gaps: int = 0  # times a gap or a restart cleared the engine's index
    last_seq: int | None = None
    dropped: dict[str, int] = field(default_factory=dict)  # by reason (DROP_REASONS)
    restarts: int = 0  # times the subscription ended and was started again

    @property
    def bad_messages(self) -> int:
        return self.dropped.get("unreadable", 0)


def next_seq_ok(last_seq: int | None, seq: int) -> bool:
    """Whether ``seq`` follows ``last_seq`` with nothing lost in between (the first batch heard
    always does: what came before it was never known)."""
    return last_seq is None or seq == last_seq + 1


class KvEventSubscriber:
    """One SUB socket and task per engine, feeding ``index``; owns them (``start``/``stop``)."""

    def __init__(
        self,
        index: KvIndex,
        endpoints: Mapping[str, str],
        metrics: ProxyMetrics | None = None,
        *,
        restart_delay_s: float = RESTART_DELAY_S,
    ) -> None:
        self.index = index
        self.endpoints = dict(endpoints)  # backend URL -> ZMQ endpoint
        self.streams = {url: StreamState() for url in self.endpoints}
        self._metrics = metrics
        self._restart_delay_s = restart_delay_s
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._decoder = msgspec.msgpack.Decoder(_Batch)
        if metrics is not None:
            for url in self.endpoints:
                for reason in DROP_REASONS:
                    metrics.kv_events_dropped.labels(url, reason)

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        for url, endpoint in self.endpoints.items():
            self._tasks[url] = asyncio.create_task(
                self._run(url, endpoint), name=f"proxy-kv-events-{url}"
            )

    async def stop(self) -> None:
        for url, task in self._tasks.items():
            await stop_task(task, f"KV event subscriber for {url}")
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _run(self, url: str, endpoint: str) -> None:
        """``_listen`` for as long as the proxy runs; each time it ends (a lost connection, or
        an error: logged with its traceback), the engine's part is cleared and a new socket
        subscribes after ``restart_delay_s``."""
        stream = self.streams[url]
        while True:
            try:
                await self._listen(url, endpoint)
                self._drop(url, "disconnected", f"the connection to {endpoint} was lost")
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception(
                    "KV events from %s: the subscription to %s ended; forgetting its cache and "
                    "subscribing again in %.1fs",
                    url,
                    endpoint,
                    self._restart_delay_s,
                )
            stream.restarts += 1
            stream.last_seq = None
            self.index.clear(url)
            await asyncio.sleep(self._restart_delay_s)

    def open_socket(self, endpoint: str) -> zmq.asyncio.Socket:
        """The SUB socket of one engine, with its bounds."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Until a connection is made, and after the engine stops, ZMQ retries by itself.
        sock.connect(endpoint)
        return sock

    async def _listen(self, url: str, endpoint: str) -> None:
        """Feeds the index until the connection is lost. ZMQ reconnects after the engine
        restarts, but not after a message over ``MAXMSGSIZE`` (a protocol error ends the
        session for good): so a lost connection (the monitor's ``DISCONNECTED``) returns, and
        ``_run`` subscribes again."""
        sock = self.open_socket(endpoint)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()
                    return
                frames = await sock.recv_multipart()
                try:
                    self.receive(url, frames)
                except Exception as e:  # a bug of ours must not end the subscription
                    self._drop(url, "failed", repr(e), exc_info=True)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _drop(self, url: str, reason: str, detail: str, *, exc_info: bool = False) -> None:
        """One message or event dropped: counted; unless harmless, the engine's part cleared.
        Logged the 1st, 2nd, 4th, 8th... time for each reason: a flood of bad input cannot
        flood the log."""
        dropped = self.streams[url].dropped
        n = dropped[reason] = dropped.get(reason, 0) + 1
        if self._metrics is not None:
            self._metrics.kv_events_dropped.labels(url, reason).inc()
        harmless = reason == "unknown_type"
        if n & (n - 1) == 0:
            logger.warning(
                "KV events from %s: dropped (%s, %d so far): %s%s",
                url,
                reason,
                n,
                detail[:200],
                "" if harmless else "; forgetting its cache",
                exc_info=exc_info,
            )
        if not harmless:
            self.index.clear(url)

    def receive(self, url: str, frames: list[bytes]) -> None:
        """One published message from ``url``'s engine."""
        stream = self.streams[url]
        try:
            _topic, seq_bytes, payload = frames
            if len(seq_bytes) != 8:
                raise ValueError(f"seq of {len(seq_bytes)} bytes, not 8")
            seq = int.from_bytes(seq_bytes, "big")
            batch = self._decoder.decode(payload)
        except (ValueError, msgspec.MsgspecError) as e:
            self._drop(url, "unreadable", f"a message we cannot read ({e})")
            return
        if not next_seq_ok(stream.last_seq, seq):
            stream.gaps += 1
            logger.warning(
                "KV events from %s: seq %d after %s (lost or restarted); forgetting its cache",
                url,
                seq,
                stream.last_seq,
            )
            self.index.clear(url)
        stream.last_seq = seq
        stream.batches += 1
        for raw in batch.events:
            try:
                event = decode_event(raw)
            except BadEvent as e:
                self._drop(url, e.reason, f"an event ({e})")
                continue
            self.index.apply(url, event)
            stream.events += 1
