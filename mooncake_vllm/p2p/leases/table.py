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

Layer by layer (``layerwise_handoff``): a lease can open while its prefill still computes, in the
request's last step, which completes the prompt (``computing``). Its blocks then belong to the
running request, not to the lease: it is granted only to acquires that take layers as they come
(``layers_ok``), the producer's workers mark each layer written (``mark``; all written: ready), and
only the engine core's finishing ``add`` (the request finished and its blocks are held) or ``abort``
(it finished without a handover; its blocks are held all the same) ends the computing. A lease ended
while computing reports its request finished only once that has come, so vLLM never frees the blocks
of a running request.

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
from mooncake_vllm.p2p.protocol import ALL_LAYERS

# ``LeaseTable.acquire``: the lease exists but cannot be granted to this acquire yet.
NOT_YET = object()


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
    computing: bool = False  # opened in its prefill's last step; that request still runs
    aborted: bool = False  # the request finished without a handover while it was acquired
    # Per layer (segment order): producer ranks that wrote it, of ``marks_needed``.
    marks: list[int] = field(default_factory=list)
    marks_needed: int = 1

    @property
    def acquired(self) -> int:
        return len(self.owners)

    @property
    def ready(self) -> int:
        """``ALL_LAYERS`` once every layer is written (a computing lease is opened only in its
        request's last step: nothing writes its blocks afterwards, and they are held until the
        lease ends whatever becomes of the request) or the request has finished; else the
        written layers' bitmask."""
        written = [n >= self.marks_needed for n in self.marks]
        if not self.computing or all(written):
            return ALL_LAYERS
        return sum(1 << i for i, w in enumerate(written) if w)

    def all_released(self) -> bool:
        return len(self.released_by) >= (len(self.owners) if self.aborted else self.readers)


def _other_prompt(transfer_id: str, handoff: Any, prompt_digest: str) -> str | None:
    """Why a pending acquire of ``prompt_digest``'s prompt may not take a lease backing
    ``handoff``, or None: a lease bound to a prompt goes only to an acquire naming that prompt
    (a holder of the transfer id alone gets nothing of another prompt's KV)."""
    held = getattr(handoff, "prompt_digest", "")
    if not held or held == prompt_digest:
        return None
    if not prompt_digest:
        return (
            f"transfer {short_id(transfer_id)} holds the KV of one prompt, and this pending "
            "acquire names none: send the request's prompt_digest with it"
        )
    return (
        f"transfer_id {short_id(transfer_id)} holds another prompt's KV: it was used for two "
        "requests (choose a new transfer_id for every request)"
    )


class NotOwner(Exception):
    """A release from a peer that did not acquire the lease: ignored, and counted."""


def _no_handover(transfer_id: str) -> str:
    return f"the prefill of transfer {short_id(transfer_id)} ended without a handover"


class LeaseTable:
    def __init__(
        self,
        ttl_s: float,
        budget_bytes: int,
        pull_hold_s: float,
        clock: Callable[[], float] = time.monotonic,
        remember_ended: int = 8192,
        marks_needed: int = 1,
        keep_reasons: bool = False,
    ):
        """``keep_reasons``: note why each request's lease ended (``take_ended_reasons``, for
        its span: tracing on)."""
        self._ttl_s = ttl_s
        self._budget_bytes = budget_bytes
        self._pull_hold_s = pull_hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._live: OrderedDict[str, Lease] = OrderedDict()  # by transfer id, oldest first
        self._ended: OrderedDict[str, str] = OrderedDict()  # transfer id -> reason (bounded)
        self._remember_ended = remember_ended
        self._finished_req_ids: set[str] = set()
        # Leases ended while computing, by transfer id: their requests, freed once finished.
        self._ended_computing: OrderedDict[str, str] = OrderedDict()
        self._marks_needed = marks_needed  # producer ranks that write each layer of a lease
        self.ended_counts: dict[str, int] = {}
        # Request -> why its lease ended, since the last ``take_ended_reasons`` (for spans).
        self.ended_reasons: dict[str, str] = {}
        self._keep_reasons = keep_reasons

    def add(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        nbytes: int,
        max_readers: int = 1,
        handoff: Any = None,
        *,
        computing: bool = False,
        layers: int = 0,
    ) -> None:
        """Opens a lease; ``computing``: in its prefill's last step, with ``layers`` layers to
        be marked. Without it, for a lease opened computing by the same request: its request
        has finished, the lease now holds the blocks."""
        with self._lock:
            old = self._live.get(transfer_id)
            if not computing and self._finish(req_id, transfer_id, nbytes):
                return
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
                computing=computing,
                marks=[0] * layers if computing else [],
                marks_needed=self._marks_needed,
            )
            self._enforce_budget()

    def _finish(self, req_id: str, transfer_id: str, nbytes: int) -> bool:
        """Under the lock: the request of a lease opened computing has finished (True), with
        its blocks held now."""
        if self._ended_computing.get(transfer_id) == req_id:  # read and released already
            del self._ended_computing[transfer_id]
            self._finished_req_ids.add(req_id)
            return True
        lease = self._live.get(transfer_id)
        if lease is None or not lease.computing or lease.req_id != req_id:
            return False
        lease.computing, lease.nbytes = False, nbytes
        if lease.state is LeaseState.HELD:
            lease.deadline_s = self._clock() + self._ttl_s
        self._enforce_budget()
        return True

    def abort(self, req_id: str, transfer_id: str) -> None:
        """The request of a lease opened computing finished without a handover (aborted, or
        preempted): refuse its readers, and end it once those that acquired it have released
        it (they may still read: vLLM keeps the blocks until then)."""
        with self._lock:
            if self._ended_computing.get(transfer_id) == req_id:
                del self._ended_computing[transfer_id]
                self._finished_req_ids.add(req_id)
                return
            lease = self._live.get(transfer_id)
            if lease is None or lease.req_id != req_id:
                self._finished_req_ids.add(req_id)  # nothing of it is held here
                return
            lease.computing, lease.aborted = False, True
            if lease.all_released():
                self._end(lease, "aborted")

    def mark(self, transfer_id: str, layer: int) -> bool:
        """A producer rank has written ``layer`` of a computing lease; True if one was."""
        with self._lock:
            lease = self._live.get(transfer_id)
            if lease is None or not lease.computing or not 0 <= layer < len(lease.marks):
                return False
            lease.marks[layer] += 1
            return True

    def progress(self, transfer_id: str, owner: bytes) -> int | str:
        """The ready layers of a lease ``owner`` acquired (``Lease.ready``), or why there are
        none to come."""
        with self._lock:
            lease = self._live.get(transfer_id)
            if lease is None:
                reason = self._ended.get(transfer_id)
                return f"transfer {short_id(transfer_id)} {reason or 'unknown'}"
            if owner not in lease.owners:
                return f"transfer {short_id(transfer_id)} was not acquired by this peer"
            if lease.aborted:
                return _no_handover(transfer_id)
            return lease.ready

    def acquire(
        self,
        transfer_id: str,
        block_ids: list[int],
        owner: bytes,
        readers: int = 1,
        *,
        pending: bool = False,
        layers_ok: bool = False,
        prompt_digest: str = "",
    ) -> Lease | str | object | None:
        """The lease, now PULLING; or a refusal reason; or None if the id is unknown; or
        ``NOT_YET`` for an acquire that must wait for the prefill to finish (a computing lease,
        and the acquire does not take layers as they come: ``layers_ok``; a consumer reading
        several producer ranks acquires the later ones with the handoff the first granted). A
        ``pending`` acquire (a pending handoff's: the consumer knows the id, not the blocks)
        names no blocks, and is granted a lease bound to a prompt only with that prompt's
        ``prompt_digest`` (an orchestrator may send one transfer id with two requests)."""
        with self._lock:
            lease = self._live.get(transfer_id)
            if lease is None:
                reason = self._ended.get(transfer_id)
                return f"transfer {short_id(transfer_id)} already {reason}" if reason else None
            if lease.aborted:
                return _no_handover(transfer_id)
            if lease.computing and not layers_ok:
                return NOT_YET
            if pending and lease.handoff is None:
                return f"transfer {short_id(transfer_id)} cannot be acquired pending"
            if pending and (why := _other_prompt(transfer_id, lease.handoff, prompt_digest)):
                return why
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
            if lease.all_released():
                reason = "aborted" if lease.aborted else "released"
                self._end(lease, "pull failed" if lease.failed else reason)
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

    def take_ended_reasons(self) -> dict[str, str]:
        """Why each lease ended since the last call, by request id."""
        with self._lock:
            out, self.ended_reasons = self.ended_reasons, {}
            return out

    def take_finished(self) -> set[str]:
        with self._lock:
            out, self._finished_req_ids = self._finished_req_ids, set()
            return out

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(x.nbytes for x in self._live.values() if not x.computing)

    @property
    def held_count(self) -> int:
        with self._lock:
            return len(self._live)

    def _enforce_budget(self) -> None:
        # A computing lease holds nothing yet: its blocks belong to the running request.
        held = sum(x.nbytes for x in self._live.values() if not x.computing)
        for lease in list(self._live.values()):  # oldest first
            if held <= self._budget_bytes:
                break
            if lease.state is LeaseState.HELD and not lease.computing:
                held -= lease.nbytes
                self._end(lease, "evicted")

    def _end(self, lease: Lease, reason: str) -> None:
        lease.state, lease.end_reason = LeaseState.ENDED, reason
        del self._live[lease.transfer_id]
        self._ended[lease.transfer_id] = reason
        while len(self._ended) > self._remember_ended:
            self._ended.popitem(last=False)
        if lease.computing:  # the request still runs: its blocks are freed once it finishes
            self._ended_computing[lease.transfer_id] = lease.req_id
            while len(self._ended_computing) > self._remember_ended:
                self._ended_computing.popitem(last=False)
        else:
            self._finished_req_ids.add(lease.req_id)
        self.ended_counts[reason] = self.ended_counts.get(reason, 0) + 1
        if self._keep_reasons:
            self.ended_reasons[lease.req_id] = reason
