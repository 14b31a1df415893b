"""The stats a worker half gathers between two of vLLM's ``get_kv_connector_stats`` calls."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar


class _Stats(Protocol):
    def is_empty(self) -> bool: ...


StatsT = TypeVar("StatsT", bound=_Stats)


class WorkerStats(Generic[StatsT]):
    """One connector's stats object, filled by the step thread and the load threads under one
    lock, and handed to vLLM whole by ``take`` (which starts a fresh one), so no count is lost
    or reported twice."""

    def __init__(self, new: Callable[[], StatsT]):
        self._new = new
        self._lock = threading.Lock()
        self._stats = new()

    @contextmanager
    def update(self) -> Iterator[StatsT]:
        with self._lock:
            yield self._stats

    def take(self) -> StatsT | None:
        """What was gathered since the last call (None when nothing was)."""
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, self._new()
            return out
