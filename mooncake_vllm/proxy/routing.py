"""Backend pools: which backend gets the next request, and which backends are healthy.

No I/O: the app reports what it saw (a request that could not connect, a probe's answer) and asks
which backend to use and which to probe. Time comes from an injected clock so the backoff
schedule is testable.

Health lifecycle of one backend::

    healthy --request or probe failed, or 3 late probes--> ejected --probe ok--> healthy
                                         ejected --probe failed--> ejected, next probe later
    healthy --refused a request: shutting down--> draining --probe failed--> ejected
                    draining --probe ok, DRAIN_RECHECK_S after its last refusal--> healthy

A backend starts healthy, so requests arriving before the first probe are served; the first
probe is due at once, so a backend that is down at startup is ejected within one probe.
Ejected backends are re-probed after ``Backoff.delay_s(consecutive_failures)``; healthy ones
every ``probe_interval_s``. A draining backend (``drain``) still answers ``/health`` with 200
while it finishes its requests, so a passing probe does not bring it back: one that fails
(it exited) does, once a later probe passes (it restarted).
"""

from __future__ import annotations

import enum
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.proxy import kv_index, prefix

# Late health probes in a row before a healthy backend is ejected (see probe_timed_out).
SLOW_PROBES_TO_EJECT = 3
# A draining backend whose probes keep passing is tried again this long after its last refusal:
# one that refuses without ever going away costs a retried leg this often, no more.
DRAIN_RECHECK_S = 10.0


class Policy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    # Prefill: by prompt prefix (``prefix.choose``); a pick without a key: least outstanding.
    PREFIX = "prefix"
    # Both pools: the backend whose prefix cache holds the longest run of the prompt, as its KV
    # events tell (``kv_index.choose``), bounded by load; nothing cached: as ``prefix``.
    KV = "kv"


class NoHealthyBackend(RuntimeError):
    """Every backend of a pool is ejected (or excluded by the caller)."""

    def __init__(self, role: str, configured: int, excluded: int = 0) -> None:
        detail = f"{configured} configured"
        if excluded:
            detail += f", {excluded} already tried"
        super().__init__(f"no healthy {role} backend ({detail})")
        self.role = role


@dataclass(frozen=True)
class Backoff:
    """Re-probe delay for an ejected backend: ``initial_s`` doubling per failed probe, capped."""

    initial_s: float = 1.0
    max_s: float = 30.0

    def delay_s(self, consecutive_failures: int) -> float:
        exponent = max(consecutive_failures - 1, 0)
        # Cap the exponent too: 2.0 ** 2000 overflows a float.
        return min(self.max_s, self.initial_s * 2.0 ** min(exponent, 64))


@dataclass(eq=False)
class Backend:
    url: str
    healthy: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None
    next_probe_at_s: float = 0.0  # on the pool's clock
    # Discovered and not yet seen healthy: probed every ``Backoff.initial_s`` without backing
    # off, so an engine that publishes itself early is in rotation soon after it serves.
    joining: bool = False
    # May see the client's Authorization and $OPENAI_API_KEY: a --prefill/--decode backend, or a
    # discovered one whose registry record verified under the shared secret.
    trusted: bool = True
    # When it last refused a request because it is shutting down (on the pool's clock); None:
    # not draining, or seen gone since.
    draining_since_s: float | None = None
    # Bytes of the request bodies this backend is computing for us (prompts, on a prefill), and
    # a prefill's recent leg time over the bytes it shared the prefill with (an exponential
    # average; None before its first answer): ``expected_wait_s``, for
    # ``--concurrent-max-wait-s``. Bytes, not requests: a long prompt costs more than a short one.
    bytes_in_flight: int = 0
    prefill_s_per_byte: float | None = None
    # --policy kv: the prompt tokens the legs in flight here must compute (a prefill) or pull
    # (a decode), as counted when each was picked: the cost model's queue
    # (``kv_index.costs``). ``pending_tokens``: the last pick's, which ``begin`` adds.
    tokens_in_flight: int = 0
    pending_tokens: int = 0

    def record_prefill(self, took_s: float, bytes_in_flight: int) -> None:
        """A prefill leg answered in ``took_s``; ``bytes_in_flight`` were on this backend when
        it was sent, its own included."""
        sample = took_s / max(bytes_in_flight, 1)
        prev = self.prefill_s_per_byte
        self.prefill_s_per_byte = sample if prev is None else prev + 0.2 * (sample - prev)

    def expected_wait_s(self) -> float:
        """Seconds until the prefill answers a leg sent now (counted in ``bytes_in_flight``),
        estimated: every byte in flight at the recent time per byte. 0 before the first answer."""
        return self.bytes_in_flight * (self.prefill_s_per_byte or 0.0)

    def snapshot(self, now_s: float) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "next_probe_in_s": round(max(self.next_probe_at_s - now_s, 0.0), 3),
            "trusted": self.trusted,
            "draining": self.draining_since_s is not None,
            "tokens_in_flight": self.tokens_in_flight,
        }


class BackendPool:
    """The backends of one role (``prefill`` or ``decode``) with their routing and health state."""

    def __init__(
        self,
        role: str,
        urls: Sequence[str],
        policy: Policy = Policy.ROUND_ROBIN,
        *,
        backoff: Backoff = Backoff(),  # frozen: safe to share as a default
        probe_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        cache: kv_index.KvIndex | None = None,
    ) -> None:
        self.role = role
        # What each backend's prefix cache holds (--policy kv); None: not known.
        self.cache = cache
        self.policy = Policy(policy)
        self.backoff = backoff
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        now_s = clock()
        self.backends: tuple[Backend, ...] = tuple(Backend(u, next_probe_at_s=now_s) for u in urls)
        # Index the next round-robin scan starts from; also breaks least-outstanding ties.
        self._next_index = 0
        self._ring: prefix.Ring | None = None  # built on the first prefix pick
        # The URLs of the last kv picks, for each backend's recent share (``kv_index.choose``).
        self._recent: deque[str] = deque(maxlen=kv_index.RECENT_PICKS)

    def _prefix_ring(self) -> prefix.Ring:
        urls = tuple(b.url for b in self.backends)
        if self._ring is None or self._ring.urls != urls:  # the pool's members changed
            self._ring = prefix.Ring.of(urls)
        return self._ring

    # ---- routing --------------------------------------------------------------------------------

    def pick(
        self,
        exclude: Iterable[Backend] = (),
        key: bytes | None = None,
        token_ids: Sequence[int] | None = None,
        identity: tuple[str | None, str | None] = (None, None),
    ) -> Backend:
        """The backend for the next request; raises NoHealthyBackend when there is none.

        Round robin takes the next healthy backend in configured order. Least outstanding takes
        the healthy backend with the fewest requests in flight, ties going round robin. Prefix
        takes the backend owning ``key`` (``prefix.prefix_key``) on the hash ring, bounded by
        load (``prefix.choose``); without a key it is least outstanding. KV takes the backend
        whose cache holds the longest run of ``token_ids`` (``kv_index.choose``) under the
        request's ``identity`` (the model it names and its cache_salt), as prefix when none
        holds a block of it or the prompt's ids are not known.
        """
        excluded = set(exclude)
        count = len(self.backends)
        if not count:
            raise NoHealthyBackend(self.role, 0)
        # Candidates in round-robin order starting at _next_index.
        order = [(self._next_index + i) % count for i in range(count)]
        candidates = [
            i for i in order if self.backends[i].healthy and self.backends[i] not in excluded
        ]
        if not candidates:
            raise NoHealthyBackend(self.role, count, len(excluded))
        if self.policy is Policy.KV and (key is not None or token_ids is not None):
            by_url = {self.backends[i].url: i for i in candidates}
            in_flight = {url: self.backends[i].in_flight for url, i in by_url.items()}
            matched: dict[str, int] = {}
            if self.cache is not None and token_ids is not None:
                matched = self.cache.matched_tokens(token_ids, by_url, *identity)
            prompt_tokens = len(token_ids) if token_ids is not None else 0
            url = kv_index.choose(
                matched,
                in_flight,
                list(by_url),
                self._prefix_ring(),
                key,
                recent_picks=Counter(self._recent),
                prompt_tokens=prompt_tokens,
                queued_tokens={url: self.backends[i].tokens_in_flight for url, i in by_url.items()},
                queue_weight=kv_index.QUEUE_WEIGHT.get(self.role, 0.0),
            )
            assert url is not None  # candidates is not empty
            self._recent.append(url)
            chosen_backend = self.backends[by_url[url]]  # round-robin position untouched
            chosen_backend.pending_tokens = max(prompt_tokens - matched.get(url, 0), 0)
            return chosen_backend
        if self.policy is Policy.PREFIX and key is not None:
            by_url = {self.backends[i].url: i for i in candidates}
            in_flight = {url: self.backends[i].in_flight for url, i in by_url.items()}
            url = prefix.choose(self._prefix_ring(), key, in_flight, by_url.keys())
            assert url is not None  # candidates is not empty
            return self.backends[by_url[url]]  # round-robin position untouched
        if self.policy in (Policy.LEAST_OUTSTANDING, Policy.PREFIX, Policy.KV):
            # min() keeps the first of equals, i.e. the earliest in round-robin order.
            chosen = min(candidates, key=lambda i: self.backends[i].in_flight)
        else:
            chosen = candidates[0]
        self._next_index = (chosen + 1) % count
        return self.backends[chosen]

    # ---- membership (discovery) -----------------------------------------------------------------

    def add(self, url: str, *, trusted: bool = False) -> Backend | None:
        """Add a backend that is not in rotation until its first health probe (due now) passes:
        a discovered engine publishes itself before its API server listens. None if present.
        ``trusted``: its record verified (see ``Backend.trusted``)."""
        if any(b.url == url for b in self.backends):
            return None
        backend = Backend(
            url, healthy=False, last_error="joined; not probed yet", joining=True, trusted=trusted
        )
        backend.next_probe_at_s = self._clock()
        self.backends = (*self.backends, backend)
        return backend

    def remove(self, url: str) -> Backend | None:
        """Take a backend out of the pool (requests already on it finish). None if absent."""
        gone = next((b for b in self.backends if b.url == url), None)
        if gone is not None:
            self.backends = tuple(b for b in self.backends if b is not gone)
            self._next_index = self._next_index % len(self.backends) if self.backends else 0
        return gone

    def begin(self, backend: Backend) -> int:
        """A leg sent to ``backend`` (just picked): the tokens it queued there, for ``end``."""
        backend.in_flight += 1
        tokens, backend.pending_tokens = backend.pending_tokens, 0
        backend.tokens_in_flight += tokens
        return tokens

    def end(self, backend: Backend, tokens: int = 0) -> None:
        backend.in_flight = max(backend.in_flight - 1, 0)
        self.settle(backend, tokens)

    def settle(self, backend: Backend, tokens: int) -> None:
        """``tokens`` of a leg from ``begin`` are done (it may still be in flight)."""
        backend.tokens_in_flight = max(backend.tokens_in_flight - tokens, 0)

    # ---- health ---------------------------------------------------------------------------------

    def eject(self, backend: Backend, reason: str) -> bool:
        """A request could not reach ``backend``. True when this ejected a healthy backend.

        Failures of requests sent before the ejection do not push the next probe further out:
        only failed probes grow the backoff.
        """
        backend.last_error = reason
        if not backend.healthy:
            return False
        backend.healthy = False
        backend.consecutive_failures = 1
        backend.next_probe_at_s = self._clock() + self.backoff.delay_s(1)
        return True

    def drain(self, backend: Backend, reason: str) -> bool:
        """``backend`` refused a request because it is shutting down (a draining vLLM). True
        when this took a healthy backend out of rotation.

        It stays out while its probes pass (it answers ``/health`` while it drains): until a
        probe fails (it exited; the next passing probe is its restart) or, for one that never
        goes away, until ``DRAIN_RECHECK_S`` after its last refusal."""
        backend.draining_since_s = self._clock()
        return self.eject(backend, reason)

    def probe_failed(self, backend: Backend, reason: str) -> bool:
        """A health probe failed. True when this ejected a healthy backend."""
        backend.draining_since_s = None  # it went away: a probe that passes later is its restart
        return self._failed_probe(backend, reason)

    def _failed_probe(self, backend: Backend, reason: str) -> bool:
        if backend.healthy:
            return self.eject(backend, reason)
        backend.last_error = reason
        backend.consecutive_failures += 1
        delay_s = self.backoff.delay_s(1 if backend.joining else backend.consecutive_failures)
        backend.next_probe_at_s = self._clock() + delay_s
        return False

    def probe_timed_out(self, backend: Backend, reason: str) -> bool:
        """A health probe got no answer in time. True when this ejected a healthy backend.

        A saturated vLLM answers ``/health`` late while it still serves every request, so a
        healthy backend is only ejected after ``SLOW_PROBES_TO_EJECT`` late probes in a row
        (requests to a backend that truly hangs meet their own timeout meanwhile)."""
        if not backend.healthy:
            return self._failed_probe(backend, reason)  # a late answer: it may still be draining
        backend.last_error = reason
        backend.consecutive_failures += 1
        if backend.consecutive_failures >= SLOW_PROBES_TO_EJECT:
            return self.eject(backend, reason)
        backend.next_probe_at_s = self._clock() + self.probe_interval_s
        return False

    def probe_ok(self, backend: Backend) -> bool:
        """A health probe succeeded. True when this brought an ejected backend back."""
        now_s = self._clock()
        if backend.draining_since_s is not None:
            if now_s - backend.draining_since_s < DRAIN_RECHECK_S:
                backend.next_probe_at_s = now_s + self.probe_interval_s  # to see it go
                return False
            backend.draining_since_s = None
        came_back = not backend.healthy
        backend.healthy = True
        backend.joining = False
        backend.consecutive_failures = 0
        backend.last_error = None
        backend.next_probe_at_s = now_s + self.probe_interval_s
        return came_back

    def due_for_probe(self) -> list[Backend]:
        now_s = self._clock()
        return [b for b in self.backends if b.next_probe_at_s <= now_s]

    def seconds_until_next_probe(self) -> float:
        now_s = self._clock()
        next_probe_at_s = min((b.next_probe_at_s for b in self.backends), default=now_s + 1.0)
        return max(next_probe_at_s - now_s, 0.0)

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    def snapshot(self) -> list[dict[str, Any]]:
        now_s = self._clock()
        out = [b.snapshot(now_s) for b in self.backends]
        if self.cache is not None:  # --policy kv: how many blocks each engine's events told of
            for entry in out:
                entry["cached_blocks"] = self.cache.cached_blocks(entry["url"])
        return out
