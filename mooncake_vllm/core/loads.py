"""What both connectors' loads share: the worker's load jobs with their deadlines (``LoadJobs``),
its report of settled loads (``MooncakeWorkerMeta``), and the destination blocks the scheduler
half keeps pinned in vLLM's block pool until every worker rank has reported the load settled
(``BlockPins``).

Why settling is separate from reporting: neither the transfer engine nor the store can cancel a
write into vLLM's blocks. A load not done by its deadline is reported failed to vLLM (whose
``kv_load_failure_policy`` then frees or recomputes the request), but its blocks may be handed
out again only once its thread has returned, i.e. once nothing it submitted can still land.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

logger = logging.getLogger(__name__)

# A load not done this long after its deadline is reported failed without waiting for its
# thread (its blocks stay pinned until the thread has returned).
REPORT_AFTER_S = 0.25


@dataclass
class MooncakeWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler: loads whose transfer-engine entries have all ended on this rank, so
    no write can land in their blocks any more (the scheduler half unpins them once every rank
    has said so). One list element per rank and load."""

    settled: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> MooncakeWorkerMeta:
        assert isinstance(other, MooncakeWorkerMeta)
        self.settled.extend(other.settled)
        return self

    @classmethod
    def of(cls, settled: list[str]) -> MooncakeWorkerMeta | None:
        """The report of ``settled`` (None when there is nothing to report)."""
        return cls(list(settled)) if settled else None


class BlockPins:
    """Blocks under a pull, held with one extra reference in vLLM's block pool until every
    worker (``tp_size``: all of them, every pipeline stage's) has reported the load settled
    (see the module docstring)."""

    def __init__(self, pool: BlockPool, tp_size: int):
        self._pool, self._tp_size = pool, tp_size
        self._pinned: dict[str, tuple[list[KVCacheBlock], int]] = {}  # → (blocks, ranks left)

    def pin(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        blocks = [self._pool.blocks[b] for b in block_ids]
        self._pool.touch(blocks)
        self._pinned[req_id] = (blocks, self._tp_size)

    def settle(self, req_ids: list[str]) -> None:
        """One element per rank that settled a load; the last rank unpins its blocks."""
        for req_id in req_ids:
            if (pinned := self._pinned.pop(req_id, None)) is None:
                continue
            blocks, ranks_left = pinned
            if ranks_left > 1:
                self._pinned[req_id] = (blocks, ranks_left - 1)
            else:
                self._pool.free_blocks(reversed(blocks))

    def __len__(self) -> int:
        return len(self._pinned)


@dataclass(frozen=True)
class LoadOutcome:
    """What became of one load, as vLLM is told it (``finished_recving``, and
    ``failed_recving`` unless ``ok``) and as the stats count it."""

    req_id: str
    ok: bool
    reason: str = ""  # why it failed
    nbytes: int = 0
    blocks: int = 0
    duration_s: float = 0.0


OutcomeT = TypeVar("OutcomeT", bound=LoadOutcome)


class LoadJob(Generic[OutcomeT]):
    """One load's state, shared by its thread and the step thread.

    Lifecycle: ``running`` → (``reported`` at the deadline, thread still busy) → ``ended`` (its
    thread returned: the load is settled). ``awaited`` False: vLLM waits for no outcome (e.g. the
    producer's lease is only to be released); the job is settled all the same.
    """

    def __init__(self, req_id: str, deadline_s: float, awaited: bool):
        self.req_id, self.deadline_s, self.awaited = req_id, deadline_s, awaited
        self.reported = False  # its outcome went to vLLM (possibly before its thread returned)
        self.resolve_s = 0.0  # spent resolving an upstream handoff's producer (for its span)
        self.future: Future[OutcomeT] | None = None
        self._lock = threading.Lock()
        self._writing = self._abandoned = False

    def start_writing(self) -> bool:
        """Called by the load's thread before its first write into the blocks: False if the job
        was abandoned at its deadline (and so must write nothing)."""
        with self._lock:
            self._writing = not self._abandoned
            return self._writing

    def abandon(self) -> bool:
        """Called by the step thread past the deadline: True if no write has started (and now
        none will)."""
        with self._lock:
            self._abandoned = self._abandoned or not self._writing
            return self._abandoned


class LoadJobs(Generic[OutcomeT]):
    """The loads in flight on one worker rank, from ``submit`` to settled (``submit``,
    ``collect`` and ``worker_meta`` are called by the step thread).

    - ``submit`` runs ``load(job)`` on the executor with a deadline ``timeout_s`` from now.
      ``load`` must not raise: it returns a failed outcome instead (``collect`` would re-raise
      on the step thread).
    - ``collect`` returns each awaited job's outcome exactly once: its own once its thread has
      returned, or ``overdue(job)`` while its thread is still busy ``REPORT_AFTER_S`` past the
      deadline (a stuck read must not hold the request for longer).
    - A job whose thread has returned is settled: ``worker_meta`` reports it once, to the
      scheduler half's ``BlockPins``.

    ``wake`` (optional) is called when a job's thread has returned and when it becomes overdue,
    so a scheduler resting between steps comes back to collect it.
    """

    def __init__(
        self,
        executor: Executor,
        *,
        noun: str = "load",
        wake: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._executor = executor
        self._noun, self._wake, self._clock = noun, wake, clock
        self._jobs: dict[str, LoadJob[OutcomeT]] = {}
        self._settled: list[str] = []  # jobs whose thread returned, for the next worker meta

    def submit(
        self,
        req_id: str,
        load: Callable[[LoadJob[OutcomeT]], OutcomeT],
        timeout_s: float,
        *,
        awaited: bool = True,
    ) -> LoadJob[OutcomeT]:
        job: LoadJob[OutcomeT] = LoadJob(req_id, self._clock() + timeout_s, awaited)
        job.future = future = self._executor.submit(load, job)
        self._jobs[req_id] = job
        if (wake := self._wake) is not None:
            timer = threading.Timer(timeout_s + REPORT_AFTER_S, wake)
            timer.daemon = True
            timer.start()
            future.add_done_callback(lambda _: timer.cancel())
            # Once the future is done, not from inside the load: a scheduler woken earlier would
            # step, find the load not done yet, and rest with nobody left to wake it.
            future.add_done_callback(lambda _: wake())
        return job

    def collect(self, overdue: Callable[[LoadJob[OutcomeT]], OutcomeT]) -> list[OutcomeT]:
        """Outcomes vLLM waits for: of jobs that ended, and ``overdue(job)`` for jobs past
        their deadline whose thread is still busy (they settle when it returns)."""
        out = []
        now = self._clock()
        for req_id, job in list(self._jobs.items()):
            assert job.future is not None
            if job.future.done():
                del self._jobs[req_id]
                self._settled.append(req_id)
                if job.awaited and not job.reported:
                    out.append(job.future.result())
                elif job.reported:
                    logger.info(
                        "request %s: the %s reported failed at its deadline has ended; its "
                        "blocks are unpinned",
                        req_id,
                        self._noun,
                    )
            elif job.awaited and not job.reported and now > job.deadline_s + REPORT_AFTER_S:
                job.reported = True
                out.append(overdue(job))
        return out

    def worker_meta(self) -> MooncakeWorkerMeta | None:
        """The jobs settled since the last call (None when there are none)."""
        meta, self._settled = MooncakeWorkerMeta.of(self._settled), []
        return meta

    def running(self) -> int:
        """Jobs whose thread has not returned yet (safe from any thread)."""
        return sum(1 for job in list(self._jobs.values()) if not job.future.done())
