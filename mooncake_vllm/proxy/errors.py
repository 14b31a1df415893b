"""What can end a client request, and what a failed backend call means.

``ProxyError`` carries the status and OpenAI-shaped body the client gets. A backend call that
raises is turned by ``classify`` into a ``BackendFailure`` of one ``FailureKind``; the kind decides
whether the call may be retried, whether the backend is ejected, and whether the client gets 502
or 504. ``LegDeadline`` is how long a call may still take, and which flag set that limit.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.proxy import http1, rewrite
from mooncake_vllm.proxy.config import ProxyConfig
from mooncake_vllm.proxy.drain import BackendDraining


class ProxyError(Exception):
    """Ends a client request with an OpenAI error body; raised anywhere in a request."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("error", {}).get("message", str(body)))
        self.status = status
        self.body = body

    @classmethod
    def of(cls, status: int, message: str, error_type: str, param: str | None = None) -> ProxyError:
        return cls(status, rewrite.openai_error(message, error_type, param))


class PoolExhausted(ProxyError):
    """No backend of a pool took the call, and none acted on it: each one tried could not be
    reached, refused it because it is shutting down, or dropped a call that is safe to repeat
    (502); or the pool had no healthy backend to begin with (503). The request can still be
    served without that pool (``legs.prefill``: the decode computes the prompt itself)."""


class LoadFailed(ProxyError):
    """A decode answered a request that carried a handoff with vLLM's error for a failed KV load
    (``kv_load_failure_policy`` ``fail``: the prefill that held the KV has gone) before any
    token: nothing reached the client, so the request may be sent again (``app.generate``)."""


@dataclass(frozen=True)
class LegDeadline:
    """How long a backend call may still take, and the configured limit behind it."""

    timeout_s: float  # enforced on the call
    limit_s: float  # the configured value, named with its flag in a 504
    flag: str

    @classmethod
    def of(cls, cfg: ProxyConfig, request_started_s: float, *, prefill: bool) -> LegDeadline:
        """The tighter of what is left of --timeout-s and, for the prefill, --prefill-timeout-s."""
        remaining_s = cfg.timeout_s - (time.monotonic() - request_started_s)
        if remaining_s <= 0:
            raise ProxyError.of(
                504, f"request timed out after {cfg.timeout_s:g}s (--timeout-s)", "timeout"
            )
        if prefill and cfg.prefill_timeout_s <= remaining_s:
            return cls(cfg.prefill_timeout_s, cfg.prefill_timeout_s, "--prefill-timeout-s")
        return cls(remaining_s, cfg.timeout_s, "--timeout-s")


class FailureKind(str, enum.Enum):
    CONNECT = "connect"  # no connection was opened: the backend never saw the request
    DISCONNECT = "disconnect"  # the connection broke after the request may have been sent
    # The answer broke HTTP/1.1 or one of the leg client's bounds (``http1.BadAnswer``); the
    # backend may have acted on the request, as for a disconnect.
    PROTOCOL = "protocol"
    TIMEOUT = "timeout"  # our deadline passed; the backend may just be busy
    DRAINING = "draining"  # it is shutting down and refused the request without acting on it


@dataclass(frozen=True)
class BackendFailure:
    kind: FailureKind
    message: str


def classify(
    exc: BaseException, leg: str, url: str, deadline: LegDeadline
) -> BackendFailure | None:
    """What an exception from a backend call means, or None when it is not a backend failure."""
    if isinstance(exc, BackendDraining):
        return BackendFailure(FailureKind.DRAINING, str(exc))
    if isinstance(exc, http1.ConnectFailed):
        return BackendFailure(FailureKind.CONNECT, f"cannot connect to {leg} backend {url}: {exc}")
    if isinstance(exc, asyncio.TimeoutError):
        message = f"{leg} backend {url} timed out after {deadline.limit_s:g}s ({deadline.flag})"
        return BackendFailure(FailureKind.TIMEOUT, message)
    if isinstance(exc, http1.BadAnswer):
        return BackendFailure(
            FailureKind.PROTOCOL, f"{leg} backend {url} sent a broken answer: {exc}"
        )
    if isinstance(exc, http1.ConnectionDropped):
        detail = str(exc) or type(exc).__name__
        return BackendFailure(
            FailureKind.DISCONNECT, f"{leg} backend {url} dropped the connection: {detail}"
        )
    return None
