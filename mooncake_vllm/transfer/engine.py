"""The only module that touches ``mooncake.engine.TransferEngine``.

Transfer-engine quirks this wrapper absorbs:
- it reports errors as negative return codes (or batch id 0), never as exceptions: turned here
  into ``TransferError`` carrying the peer and the entry count;
- any method called before a successful ``initialize`` segfaults: the engine object is only kept
  once ``initialize`` returned 0;
- ``get_batch_transfer_status`` and ``batch_transfer_sync_read`` spin a core until the batch ends:
  never called; ``transfer_check_status`` polls (without blocking) one-entry batches instead;
- it reads its transport from the environment (``MC_FORCE_TCP``), not from ``protocol``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.core.os_threads import adopt_native_threads, native_threads
from mooncake_vllm.core.planning import Region

logger = logging.getLogger(__name__)

# transfer_check_status: 1 done and 0 pending (the batch is freed on 1 and -1); -1 failed; -2
# timed out (only with MC_SLICE_TIMEOUT, which we do not set).
_CHECK_DONE, _CHECK_PENDING, _CHECK_TIMED_OUT = 1, 0, -2
# Poll interval: starts short so a 1-15 ms read is seen done promptly, grows with the read's age
# (at most a 20th of it, capped) so a long read costs a few dozen status calls per second.
_MIN_POLL_S, _MAX_POLL_S = 0.0001, 0.005
_SCRATCH_BYTES = 64
_CONNECT_MARGIN_S = 1.0
_WARM_UP_RETRY_S = 0.02  # between failed warm-up reads


class EngineInitError(RuntimeError):
    pass


class TransferError(RuntimeError):
    def __init__(self, message: str, *, peer: str, entries: int, code: int | None = None):
        super().__init__(f"{message} (peer {peer}, {entries} entries, code {code})")
        self.peer, self.entries, self.code = peer, entries, code


class TransferTimeout(TransferError):
    pass


@dataclass(frozen=True)
class ReadResult:
    bytes: int
    entries: int
    duration_s: float
    retries: int = 0  # entries read again after a failed attempt
    stalls: int = 0  # of those, attempts the engine dropped for making no progress


class TransferAgent:
    """This process's one Mooncake transfer engine, initialized, with the memory it registered:
    how a worker registers its KV cache and reads a peer's (the name is NIXL's word for the same
    role, and says it is neither Mooncake's class nor vLLM's engine core)."""

    def __init__(
        self,
        hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        env: Mapping[str, str] = {},
    ):
        """``metadata_server`` is ``P2PHANDSHAKE`` or the http URL of this worker's bridge."""
        # Set before import/initialize: the engine reads these once.
        os.environ.update(env)
        threads_before = native_threads()
        from mooncake.engine import TransferEngine as _TE

        te = _TE()
        rc = te.initialize(hostname, metadata_server, protocol, device_name)
        # On TCP the engine's threads (its asio I/O thread moves every byte of a read, on both
        # sides) sleep in epoll between transfers; behind vLLM's busy-waiting workers they waited
        # for a CPU at every wake-up. Threads of other transports (RDMA pollers) may spin: left
        # alone. New threads named like this one are the engine's.
        own_name = native_threads().get(threading.get_native_id(), "")
        started = [
            t for t, n in native_threads().items() if t not in threads_before and n == own_name
        ]
        adopt_native_threads(started, "mc-te", realtime=protocol == "tcp")
        if rc != 0:
            raise EngineInitError(
                f"transfer engine initialize({hostname!r}, {_shown(metadata_server)!r}, "
                f"{protocol!r}, "
                f"{device_name!r}) returned {rc}; check the metadata server is reachable and the "
                "address is local"
            )
        self._adopt(te, hostname, p2p=metadata_server == "P2PHANDSHAKE")

    @classmethod
    def wrapping(cls, te: Any, hostname: str = "test:1", p2p: bool = True) -> TransferAgent:
        """Wrap an engine-like object already initialized (tests pass a fake one)."""
        engine = cls.__new__(cls)
        engine._adopt(te, hostname, p2p)
        return engine

    def _adopt(self, te: Any, hostname: str, p2p: bool) -> None:
        self._te = te
        self._hostname = hostname
        self._p2p = p2p
        self._registered: list[int] = []
        # Peers this engine has read from (handshake done), and the incarnation read from.
        self._warm: dict[str, str] = {}
        self._scratch: ctypes.Array | None = None

    @property
    def segment_name(self) -> str:
        """The name peers use to reach this engine: with P2P handshake the host and the RPC port
        the engine picked; with a metadata store the hostname it was initialized with."""
        if not self._p2p:
            return self._hostname
        return f"{self._hostname.rsplit(':', 1)[0]}:{self._te.get_rpc_port()}"

    def register(self, addr: int, length: int, location: str = "*") -> None:
        rc = self._te.register_memory(addr, length, location)
        if rc != 0:
            raise EngineInitError(f"register_memory({addr:#x}, {length}) returned {rc}")
        self._registered.append(addr)

    def read(
        self,
        peer: str,
        regions: Sequence[Region],
        *,
        deadline: float,
        stall_s: float,
        max_in_flight: int,
        should_start: Callable[[], bool] = lambda: True,
    ) -> ReadResult:
        """Copy every ``src_addr`` on ``peer`` to the local ``dst_addr``; raise ``TransferError``
        (``TransferTimeout`` past ``deadline``) if some region could not be read.

        Each region is its own one-entry batch, so ``transfer_check_status`` (which never blocks,
        but sees only a batch's first entry) tells exactly when it ends; the blocking status calls
        spin a core for the whole transfer. Between polls the thread sleeps.

        A failed entry is read again (reads are idempotent) while a retry can still finish by
        ``deadline`` and the peer has delivered something in this read: on TCP the engine drops
        an entry's connection after ``stall_s`` without progress (``MC_TCP_PROGRESS_TIMEOUT_SEC``),
        so a stalled entry fails and is retried; a peer that delivered nothing fails the read.

        No write can land after this returns or raises: it only returns once every entry it
        submitted has ended (done, or failed with its connection closed), so the destination
        blocks can be handed back to vLLM. Entries that make no progress end ``stall_s`` after
        their last progress; no new attempt starts unless it can end by ``deadline``.
        ``should_start`` is asked once before the first submit (a pull abandoned meanwhile
        submits nothing)."""
        start = time.monotonic()
        todo = deque((r, 0) for r in regions)  # (region, failed attempts so far)
        in_flight: dict[int, tuple[Region, int, float]] = {}  # batch id -> (region, tries, t0)
        retries = stalls = completed = 0
        last_done_s = float("-inf")
        failure: TransferError | None = None
        if not should_start():
            raise TransferError("pull abandoned before its read started", peer=peer, entries=0)
        while todo or in_flight:
            while todo and len(in_flight) < max_in_flight and failure is None:
                region, tries = todo[0]
                # A submit can itself block (it connects on this thread: ~1 s to a peer that
                # does not accept), so a retry needs a stall timeout and that second to spare.
                now = time.monotonic()
                if now >= deadline or (tries and now + stall_s + _CONNECT_MARGIN_S > deadline):
                    failure = TransferTimeout(
                        f"{len(todo)} regions unread by the deadline", peer=peer, entries=len(todo)
                    )
                    break
                todo.popleft()
                bid = self._te.batch_transfer_async_read(
                    peer, [region.dst_addr], [region.src_addr], [region.length]
                )
                if bid == 0:  # refused at submit (e.g. the peer's handshake failed): retry
                    todo.append((region, tries + 1))
                    retries += 1
                    break  # back off one poll interval before submitting again
                in_flight[bid] = (region, tries, time.monotonic())
            for bid, (region, tries, t0) in list(in_flight.items()):
                status = self._te.transfer_check_status(bid)
                if status in (_CHECK_PENDING, _CHECK_TIMED_OUT):
                    continue
                del in_flight[bid]
                now = time.monotonic()
                if status == _CHECK_DONE:
                    completed, last_done_s = completed + 1, now
                    continue
                stalled = now - t0 >= stall_s
                stalls += stalled
                # Retry only a peer that is alive: for a stall, one that completed an entry
                # while this one sat idle. A retry to a frozen peer waits in connect, which the
                # engine's progress timeout does not cover, and the pull would end late.
                alive = last_done_s >= t0 + stall_s / 2 if stalled else completed > 0
                if not alive:
                    failure = failure or TransferError(
                        "no progress from the peer", peer=peer, entries=len(in_flight) + 1
                    )
                    continue
                retries += 1
                todo.append((region, tries + 1))
            if failure is not None and not in_flight:
                raise failure
            if not todo and not in_flight:
                break
            age = time.monotonic() - start
            time.sleep(min(_MAX_POLL_S, max(_MIN_POLL_S, age / 20)))
        return ReadResult(
            bytes=sum(r.length for r in regions),
            entries=len(regions),
            duration_s=time.monotonic() - start,
            retries=retries,
            stalls=stalls,
        )

    def warm_up(
        self, peer: str, src_addr: int, *, deadline: float, stall_s: float, incarnation: str = ""
    ) -> None:
        """Read a few bytes from ``peer`` into a private scratch buffer: the first contact with a
        peer does the engine's handshake on the calling thread, which can block for long on a
        starved or dead peer. Doing it here keeps that wait off the KV blocks (see ``read``).
        A failed attempt is retried while one can still end by ``deadline``.

        Again for a new ``incarnation`` of a peer (restarted under the same segment name): until
        the engine has refreshed that segment's metadata (``engine_env``: every 5 s with a store)
        its reads fail, and here they are retried, not reported as a failed pull."""
        if self._warm.get(peer) == incarnation:
            return
        if self._scratch is None:
            self._scratch = ctypes.create_string_buffer(_SCRATCH_BYTES)
            self.register(ctypes.addressof(self._scratch), _SCRATCH_BYTES)
        dst = ctypes.addressof(self._scratch)
        status = None
        while status is None or time.monotonic() + stall_s + _CONNECT_MARGIN_S <= deadline:
            bid = self._te.batch_transfer_async_read(peer, [dst], [src_addr], [_SCRATCH_BYTES])
            status = -1
            if bid != 0:  # 0: refused at submit (the handshake failed): back off below
                sleep_s = _MIN_POLL_S
                while (status := self._te.transfer_check_status(bid)) in (
                    _CHECK_PENDING,
                    _CHECK_TIMED_OUT,
                ):
                    time.sleep(sleep_s)
                    sleep_s = min(2 * sleep_s, _MAX_POLL_S)
            if status == _CHECK_DONE:
                self._warm[peer] = incarnation
                return
            time.sleep(_WARM_UP_RETRY_S)  # e.g. stale metadata of a restarted peer: not a spin
        raise TransferError("no read from the peer succeeded", peer=peer, entries=1, code=status)

    def close(self) -> None:
        for addr in self._registered:
            rc = self._te.unregister_memory(addr)
            if rc != 0:
                logger.warning("unregister_memory(%#x) returned %d", addr, rc)
        self._registered.clear()
        # Dropping the engine now runs its destructor, which removes its metadata keys, while
        # the metadata bridge that serves them is still up.
        self._te = None


def _shown(metadata_server: str) -> str:
    """``metadata_server`` for a log line: the bridge's URL without its per-start secret path
    segment (``store_bridge``: ``http://127.0.0.1:PORT/<secret>/metadata``)."""
    return re.sub(r"^(https?://[^/]+/)[^/]+(/metadata)$", r"\1<secret>\2", metadata_server)
