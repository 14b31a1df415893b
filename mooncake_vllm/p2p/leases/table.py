"""Producer-side leases on held KV blocks.

A finished prefill's blocks stay allocated (vLLM ``delay_free``) until its lease ends. A lease ends
exactly once, for one reason: released by the consumer, expired (TTL), evicted (held bytes over
``kv_buffer_size``, oldest first) or superseded (a newer request reused the transfer id). Ended
leases are reported to vLLM as finished-sending, which frees the blocks; a later acquire of an
ended lease is refused with the reason, never served stale.

Lifecycle: ``HELD --acquire--> PULLING --release--> ENDED``; HELD/PULLING --ttl/evict--> ENDED.
A PULLING lease is not evicted, and expires only at its pull deadline, so a live copy is never
pulled from under the consumer.

Readers: a lease is pulled by the consumer ranks that read heads from it (per-head K/V: one table
per producer rank; ``planning.lease_readers``), or by every consumer rank (an MLA latent is
replicated across TP ranks: one table serves all producer ranks). The first ``Acquire`` says how
many consumer ranks will read. It ends when all its readers have released it; until then it stays
pinned (or expires at the pull deadline if a reader never comes).

Ownership: an ``Acquire`` must name exactly the hold's blocks and carries a random owner token;
only a ``Release`` with the token of an acquire of that lease ends it (a stranger who never
acquired, or who guessed nothing, changes nothing). ``readers`` is bounded by the hold's
``max_readers`` and fixed by the first acquire.

Used by the lease server's one thread (``leases.process``); locked all the same.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mooncake_vllm.core.auth import short_id


class LeaseState(enum.Enum):
    HELD = "held"
    PULLING = "pulling"
    ENDED = "ended"


@dataclass
class Lease:
    req_id: str
    transfer_id: str
    block_ids: list[int]
    nbytes: int
    deadline_s: float
    state: LeaseState = LeaseState.HELD
    end_reason: str = ""
    max_readers: int = 1  # the most consumer ranks the hold allows
    readers: int = 1  # consumer ranks that pull it, set by the first acquire
    owners: set[bytes] = field(default_factory=set)  # owner tokens of its acquires
    released_by: set[bytes] = field(default_factory=set)
    failed: bool = False  # a reader released it with its pull failed
    handoff: Any = None  # the handoff it backs (``protocol.Handoff``), for pending acquires

    @property
    def acquired(self) -> int:
        return len(self.owners)


class NotOwner(Exception):
    """A release from a peer that did not acquire the lease: ignored, and counted."""


class LeaseTable:
    def __init__(
        self,
        ttl_s: float,
        budget_bytes: int,
        pull_hold_s: float,
        clock: Callable[[], float] = time.monotonic,
        remember_ended: int = 8192,
    ):
        self._ttl_s = ttl_s
        self._budget_bytes = budget_bytes
        self._pull_hold_s = pull_hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._live: OrderedDict[str, Lease] = OrderedDict()  # by transfer id, oldest first
        self._ended: OrderedDict[str, str] = OrderedDict()  # transfer id -> reason (bounded)
        self._remember_ended = remember_ended
        self._finished_req_ids: set[str] = set()
        self.ended_counts: dict[str, int] = {}

    def add(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        nbytes: int,
        max_readers: int = 1,
        handoff: Any = None,
    ) -> None:
        with self._lock:
            old = self._live.get(transfer_id)
            if old is not None:
                self._end(old, "superseded")
            self._live[transfer_id] = Lease(
                req_id,
                transfer_id,
                list(block_ids),
                nbytes,
                self._clock() + self._ttl_s,
                max_readers=max_readers,
                handoff=handoff,
            )
            self._enforce_budget()

    def acquire(
        self,
        transfer_id: str,
        block_ids: list[int],
        owner: bytes,
        readers: int = 1,
        *,
        pending: bool = False,
    ) -> Lease | str | None:
        """The lease, now PULLING; or a refusal reason; or None if the id is unknown. A
        ``pending`` acquire (a pending handoff's: the consumer knows the id, not the blocks)
        names no blocks."""
        with self._lock:
            lease = self._live.get(transfer_id)
            if lease is None:
                reason = self._ended.get(transfer_id)
                return f"transfer {short_id(transfer_id)} already {reason}" if reason else None
            if pending and lease.handoff is None:
                return f"transfer {short_id(transfer_id)} cannot be acquired pending"
            if not pending and list(block_ids) != lease.block_ids:
                return f"transfer {short_id(transfer_id)}: the blocks are not the lease's"
            if not 1 <= readers <= lease.max_readers:
                return f"readers={readers} outside 1..{lease.max_readers}"
            if lease.state is LeaseState.PULLING:
                if readers != lease.readers:
                    return f"readers={readers}, the lease was acquired for {lease.readers}"
                if lease.acquired >= lease.readers or owner in lease.owners:
                    return f"transfer {short_id(transfer_id)} is already being pulled"
            lease.readers = readers
            lease.owners.add(owner)
            lease.state = LeaseState.PULLING
            lease.deadline_s = self._clock() + self._pull_hold_s
            return lease

    def release(self, transfer_id: str, owner: bytes, ok: bool = True) -> bool:
        """A reader is done (``ok`` false: its pull failed); the lease ends with the last
        reader's release. False if the lease is not live (already ended, or unknown): nothing
        to do. Raises ``NotOwner`` if ``owner`` acquired no share of it."""
        with self._lock:
            lease = self._live.get(transfer_id)
            if lease is None:
                return False
            if owner not in lease.owners:
                raise NotOwner(transfer_id)
            if owner in lease.released_by:
                return True
            lease.released_by.add(owner)
            lease.failed = lease.failed or not ok
            if len(lease.released_by) >= lease.readers:
                self._end(lease, "pull failed" if lease.failed else "released")
            return True

    def expire(self) -> None:
        now = self._clock()
        with self._lock:
            for lease in [x for x in self._live.values() if x.deadline_s <= now]:
                self._end(lease, "expired")

    def is_live(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._live

    def ended_reason(self, transfer_id: str) -> str | None:
        with self._lock:
            return self._ended.get(transfer_id)

    def next_deadline_s(self) -> float | None:
        """When the earliest live lease expires (None if none is live)."""
        with self._lock:
            return min((x.deadline_s for x in self._live.values()), default=None)

    def take_ended_counts(self) -> dict[str, int]:
        """Leases ended since the last call, by reason."""
        with self._lock:
            out, self.ended_counts = self.ended_counts, {}
            return out

    def take_finished(self) -> set[str]:
        with self._lock:
            out, self._finished_req_ids = self._finished_req_ids, set()
            return out

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(x.nbytes for x in self._live.values())

    @property
    def held_count(self) -> int:
        with self._lock:
            return len(self._live)

    def _enforce_budget(self) -> None:
        held = sum(x.nbytes for x in self._live.values())
        for lease in list(self._live.values()):  # oldest first
            if held <= self._budget_bytes:
                break
            if lease.state is LeaseState.HELD:
                held -= lease.nbytes
                self._end(lease, "evicted")

    def _end(self, lease: Lease, reason: str) -> None:
        lease.state, lease.end_reason = LeaseState.ENDED, reason
        del self._live[lease.transfer_id]
        self._ended[lease.transfer_id] = reason
        while len(self._ended) > self._remember_ended:
            self._ended.popitem(last=False)
        self._finished_req_ids.add(lease.req_id)
        self.ended_counts[reason] = self.ended_counts.get(reason, 0) + 1
