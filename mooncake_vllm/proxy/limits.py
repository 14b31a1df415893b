"""Per-client limits (``--client-max-concurrency``, ``--client-rate``): pure, on an injected clock.

A client is the API key it presented when the proxy checked it (``--api-key*``), else its remote
address: a key the proxy does not check is the client's to invent, one per request. Each client
has a token bucket (``rate_per_s`` tokens a second, at most ``burst``; a request takes one) and a
count of its requests in flight. ``ClientLimits.acquire`` either admits a request, giving a
``ClientSlot`` the caller releases when the answer has ended (a stream: when it is closed), or
refuses it with how long to wait (``Refusal.retry_after_s``, the 429's ``Retry-After``).

Memory is bounded: a client with nothing in flight and a full bucket is the same as one never
seen, so it is forgotten; beyond ``max_clients`` idle clients are forgotten oldest first even with
a bucket not yet full (their debt is forgiven; only many addresses at once can cause that). A
client with requests in flight is never forgotten: there are at most as many of those as requests
in flight.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# Clients remembered at most (beyond the ones with requests in flight).
MAX_TRACKED_CLIENTS = 65_536
# Oldest entries looked at per acquire when forgetting idle clients: amortised O(1).
_SWEEP_PER_ACQUIRE = 4
# What a 429 for too many requests in flight tells the client to wait: the proxy cannot know
# when one of them ends.
CONCURRENCY_RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused and how long the client should wait before retrying."""

    reason: str  # "concurrency" | "rate" (the metric's label)
    retry_after_s: float
    message: str

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` in whole seconds, rounded up, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass
class _Client:
    in_flight: int
    tokens: float  # as of updated_s
    updated_s: float


class ClientSlot:
    """One admitted request; ``release()`` is idempotent: call it on every path.

    The request's own end releases it (``release_unless_handed_over``) unless a streamed answer
    took it over (``hand_over``), which then releases it when the stream ends.
    """

    def __init__(self, limits: ClientLimits, client: str) -> None:
        self._limits = limits
        self.client = client
        self.handed_over = False
        self._released = False

    def hand_over(self) -> None:
        self.handed_over = True

    def release_unless_handed_over(self) -> None:
        if not self.handed_over:
            self.release()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._limits._release(self.client)


class ClientLimits:
    """Token buckets and in-flight counts per client; no I/O, time from ``clock``."""

    def __init__(
        self,
        *,
        max_concurrency: int | None = None,
        rate_per_s: float | None = None,
        burst: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = MAX_TRACKED_CLIENTS,
    ) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if rate_per_s is not None and rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        self.max_concurrency = max_concurrency
        self.rate_per_s = rate_per_s
        self.burst = float(default_burst(rate_per_s) if burst is None else burst)
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self._clock = clock
        self._max_clients = max_clients
        # Least recently touched first: where idle clients are looked for.
        self._clients: OrderedDict[str, _Client] = OrderedDict()

    def __len__(self) -> int:
        """Clients remembered (tests check the bound)."""
        return len(self._clients)

    def acquire(self, client: str) -> ClientSlot | Refusal:
        """Admit one request of ``client`` (a slot to release) or refuse it."""
        now_s = self._clock()
        self._forget_idle(now_s)
        state = self._clients.get(client)
        if state is None:
            state = _Client(in_flight=0, tokens=self.burst, updated_s=now_s)
            self._clients[client] = state
        else:
            self._clients.move_to_end(client)
            self._refill(state, now_s)
        if self.max_concurrency is not None and state.in_flight >= self.max_concurrency:
            return Refusal(
                "concurrency",
                CONCURRENCY_RETRY_AFTER_S,
                f"too many requests in flight for this client: at most {self.max_concurrency} "
                "at once (--client-max-concurrency)",
            )
        if self.rate_per_s is not None:
            if state.tokens < 1.0:
                wait_s = (1.0 - state.tokens) / self.rate_per_s
                return Refusal(
                    "rate",
                    wait_s,
                    f"rate limit: at most {self.rate_per_s:g} requests/s per client with bursts "
                    f"of {self.burst:g} (--client-rate, --client-burst); retry in {wait_s:.2f}s",
                )
            state.tokens -= 1.0
        state.in_flight += 1
        return ClientSlot(self, client)

    def _release(self, client: str) -> None:
        state = self._clients.get(client)
        if state is None:  # cannot happen while in flight; tolerate it rather than raise
            return
        state.in_flight = max(state.in_flight - 1, 0)
        now_s = self._clock()
        self._refill(state, now_s)
        if self._forgettable(state):
            del self._clients[client]

    def _refill(self, state: _Client, now_s: float) -> None:
        if self.rate_per_s is not None:
            elapsed_s = max(now_s - state.updated_s, 0.0)
            state.tokens = min(self.burst, state.tokens + elapsed_s * self.rate_per_s)
        state.updated_s = now_s

    def _forgettable(self, state: _Client) -> bool:
        """Nothing in flight and a full bucket: the same as a client never seen."""
        return state.in_flight == 0 and state.tokens >= self.burst

    def _forget_idle(self, now_s: float) -> None:
        for _ in range(_SWEEP_PER_ACQUIRE):
            if not self._clients:
                return
            client, state = next(iter(self._clients.items()))
            if state.in_flight:
                self._clients.move_to_end(client)  # busy: look at the next one
                continue
            self._refill(state, now_s)
            if self._forgettable(state) or len(self._clients) >= self._max_clients:
                del self._clients[client]
                continue
            return  # the oldest idle client still owes tokens: so, most likely, do the newer


def default_burst(rate_per_s: float | None) -> int:
    """One second's worth of requests, at least one."""
    return 1 if rate_per_s is None else max(1, math.ceil(rate_per_s))
