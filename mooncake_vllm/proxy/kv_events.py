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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from mooncake_vllm.proxy.health import stop_task
from mooncake_vllm.proxy.kv_index import KvIndex

logger = logging.getLogger(__name__)


@dataclass
class StreamState:
    """What one engine's event stream has delivered."""

    batches: int = 0
    events: int = 0
    gaps: int = 0  # times a gap or a restart cleared the engine's index
    last_seq: int | None = None
    bad_messages: int = 0


def next_seq_ok(last_seq: int | None, seq: int) -> bool:
    """Whether ``seq`` follows ``last_seq`` with nothing lost in between (the first batch heard
    always does: what came before it was never known)."""
    return last_seq is None or seq == last_seq + 1


class KvEventSubscriber:
    """One SUB socket and task per engine, feeding ``index``; owns them (``start``/``stop``)."""

    def __init__(self, index: KvIndex, endpoints: Mapping[str, str]) -> None:
        self.index = index
        self.endpoints = dict(endpoints)  # backend URL -> ZMQ endpoint
        self.streams = {url: StreamState() for url in self.endpoints}
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._decoder = msgspec.msgpack.Decoder()

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        for url, endpoint in self.endpoints.items():
            self._tasks[url] = asyncio.create_task(
                self._listen(url, endpoint), name=f"proxy-kv-events-{url}"
            )

    async def stop(self) -> None:
        for url, task in self._tasks.items():
            await stop_task(task, f"KV event subscriber for {url}")
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _listen(self, url: str, endpoint: str) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)  # ZMQ reconnects by itself when the engine restarts
        try:
            while True:
                frames = await sock.recv_multipart()
                self.receive(url, frames)
        finally:
            sock.close(linger=0)

    def receive(self, url: str, frames: list[bytes]) -> None:
        """One published message from ``url``'s engine."""
        stream = self.streams[url]
        try:
            _topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            _ts, events, *_rank = self._decoder.decode(payload)
        except (ValueError, TypeError, msgspec.DecodeError):
            stream.bad_messages += 1
            logger.warning("KV events from %s: a message we cannot read; forgetting its cache", url)
            self.index.clear(url)
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
        for event in events:
            if isinstance(event, dict):
                self.index.apply(url, event)
                stream.events += 1
