"""The only module that touches ``mooncake.engine.TransferEngine``.

Transfer-engine quirks this wrapper absorbs:
- it reports errors as negative return codes (or batch id 0), never as exceptions: turned here
  into ``TransferError`` carrying the peer and the entry count;
- any method called before a successful ``initialize`` segfaults: the engine object is only kept
  once ``initialize`` returned 0;
- ``get_batch_transfer_status`` frees the batch once it reports a final state (0 done, -1 failed):
  a batch is polled until then and never again;
- it reads its transport from the environment (``MC_FORCE_TCP``), not from ``protocol``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mooncake_vllm.planning import Region, chunk

logger = logging.getLogger(__name__)

_STATUS_DONE, _STATUS_PENDING = 0, 1
# Polling backoff cap: a read is seen done up to this late (~half of it on average). It was 2 ms,
# i.e. ~1 ms late on a 1-15 ms pull; 0.25 ms costs ~4000 status calls (µs each) per second of
# reading. On 2 shared cores the transfer benchmark could not tell the two apart beyond its noise.
_MAX_POLL_SLEEP_S = 0.00025


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
    batches: int
    duration_s: float


class TransferEngine:
    """One initialized transfer engine with the memory it registered."""

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
        from mooncake.engine import TransferEngine as _TE

        te = _TE()
        rc = te.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise EngineInitError(
                f"transfer engine initialize({hostname!r}, {metadata_server!r}, {protocol!r}, "
                f"{device_name!r}) returned {rc}; check the metadata server is reachable and the "
                "address is local"
            )
        self._te = te
        self._hostname = hostname
        self._p2p = metadata_server == "P2PHANDSHAKE"
        self._registered: list[int] = []
        self._lock = threading.Lock()

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
        max_entries: int,
        deadline: float,
        settle_deadline: float | None = None,
    ) -> ReadResult:
        """Copy every ``src_addr`` on ``peer`` to the local ``dst_addr``.

        All batches are in flight at once, polled with a short sleep (no spinning). Raises
        ``TransferError`` on failure and ``TransferTimeout`` once ``deadline`` has passed; reads
        still in flight then are polled until ``settle_deadline`` first, so that, when it
        returns, no write is normally left to land in the destination later."""
        settle_deadline = max(deadline, settle_deadline or deadline)
        start = time.monotonic()
        batches: list[tuple[int, int]] = []  # (batch id, entries)
        for part in chunk(regions, max_entries):
            bid = self._te.batch_transfer_async_read(
                peer,
                [r.dst_addr for r in part],
                [r.src_addr for r in part],
                [r.length for r in part],
            )
            if bid == 0:
                self._drain(peer, batches, deadline, settle_deadline)
                raise TransferError("batch submit refused", peer=peer, entries=len(part))
            batches.append((bid, len(part)))
        self._drain(peer, batches, deadline, settle_deadline, raise_on_error=True)
        return ReadResult(
            bytes=sum(r.length for r in regions),
            entries=len(regions),
            batches=len(batches),
            duration_s=time.monotonic() - start,
        )

    def _drain(
        self,
        peer: str,
        batches: list[tuple[int, int]],
        deadline: float,
        settle_deadline: float,
        raise_on_error: bool = False,
    ) -> None:
        pending = list(batches)
        failure: TransferError | None = None
        late = False
        sleep_s = 0.0001
        while pending:
            still = []
            for bid, n in pending:
                status = self._te.get_batch_transfer_status([bid])
                if status == _STATUS_PENDING:
                    still.append((bid, n))
                elif status != _STATUS_DONE and failure is None:
                    failure = TransferError("batch read failed", peer=peer, entries=n, code=status)
            pending = still
            if not pending:
                break
            now = time.monotonic()
            late = late or now > deadline
            if now > settle_deadline:
                n = sum(e for _, e in pending)
                logger.error(
                    "%d read entries from %s still in flight %.1fs past the deadline; they may "
                    "land later", n, peer, now - deadline,
                )  # fmt: skip
                raise TransferTimeout("read not finished by the deadline", peer=peer, entries=n)
            time.sleep(sleep_s)
            # A pull's end is seen at most _MAX_POLL_SLEEP_S late; a status poll costs ~µs.
            sleep_s = min(sleep_s * 2, _MAX_POLL_SLEEP_S)
        if failure and raise_on_error:
            raise failure
        if late:
            n = sum(e for _, e in batches)
            raise TransferTimeout("read finished after the deadline", peer=peer, entries=n)

    def close(self) -> None:
        with self._lock:
            for addr in self._registered:
                rc = self._te.unregister_memory(addr)
                if rc != 0:
                    logger.warning("unregister_memory(%#x) returned %d", addr, rc)
            self._registered.clear()
            # Dropping the engine now runs its destructor, which removes its metadata keys,
            # while the metadata bridge that serves them is still up.
            self._te = None
