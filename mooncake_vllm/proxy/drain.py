"""A backend that is shutting down: what its refusals look like, and reading up to the first token.

vLLM (0.32) started with ``--shutdown-timeout N`` drains when its API server gets SIGTERM: the
engine stops admitting requests, finishes the ones it has (the KV a prefill holds for decodes
included: our leases keep its engine stepping) for up to N seconds, then exits. The API server
keeps answering meanwhile, ``/health`` with 200 until it stops listening, and a new request in
one of two ways (measured, ``test_xpyd_e2e``'s rolling restart):

- while the engine drains: at once, HTTP 200, every choice finished with ``"abort"``, no token
  (a stream: no token event, then ``[DONE]``): the engine dropped the request unscheduled;
- once the engine has finished and left its loop (its workers take seconds to exit): the
  request never reaches an engine, and waits; when the engine is gone it gets HTTP 500 with
  vLLM's ``EngineDeadError`` message, or (a race in vLLM's teardown) no answer until the client
  gives up. With discovery the engine's registry record is deleted as it leaves its loop, and
  the proxy sends the calls still waiting there elsewhere once the record has stayed away for
  ``--discover-grace-s`` (``failover.Backends.abandon``; sooner, it may have lapsed under a live
  engine, ``discovery``). The API server stops listening only after its engine client has
  stopped, so once a health probe finds nothing listening the calls still waiting there are
  sent elsewhere too (``health.HealthProber.probe``), static backends' included.

Either way the backend did not act on the request: the proxy takes it out of rotation until it
has restarted (``routing.BackendPool.drain``) and sends the leg to another backend, the decode
leg with the same handoff (nothing pulled it). An engine that crashed answers the same 500; it
is handled the same way (a decode that had pulled the KV leaves nothing to pull: the next decode
recomputes the prompt, per its ``kv_load_failure_policy``).

``refusal`` tells such an answer apart from a real one: a real completion has a token, or a
finish reason other than ``"abort"``, in some choice. ``read_head`` reads a decode's answer up to
that point (a stream's first token event) before the proxy commits to it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mooncake_vllm.proxy import http1

# A stream is read this far at most looking for its first token; beyond it, it is taken as real.
# Also the most of an error body read to look for EngineDeadError.
MAX_HEAD_BYTES = 64 * 1024
# vllm.v1.engine.exceptions.EngineDeadError's message: the engine core has exited.
_ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue"

# vllm.exceptions.GenerationError's message and type: a request finished with finish_reason
# "error" before any token, which a decode answers when its KV load failed under
# kv_load_failure_policy "fail" (HTTP 500, or a stream's only event).
_GENERATION_ERROR = ("Internal server error", "InternalServerError")

ABORTED = "it answered 'abort' without a token"
ENGINE_GONE = "its engine has exited (EngineDeadError)"
LEFT = "it left the registry (stopped) before answering"


class BackendDraining(Exception):
    """The backend answered a request without acting on it because it is shutting down."""

    def __init__(self, role: str, url: str, why: str) -> None:
        super().__init__(f"{role} backend {url} is shutting down: {why}")


def _produced(choice: dict[str, Any]) -> bool:
    """A choice (whole or a stream's delta) that carries output or ended other than by abort."""
    if choice.get("finish_reason") not in (None, "abort"):
        return True
    if choice.get("text") or choice.get("token_ids"):
        return True
    for key in ("message", "delta"):  # chat
        part = choice.get(key)
        if isinstance(part, dict) and (
            part.get("content") or part.get("tool_calls") or part.get("reasoning_content")
        ):
            return True
    return False


def refused(answer: Any) -> bool:
    """True for a whole 2xx completion answer (parsed JSON) that is a draining engine's
    refusal: choices, all finished with ``"abort"``, none with output."""
    if not isinstance(answer, dict):
        return False
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(
        isinstance(c, dict) and c.get("finish_reason") == "abort" and not _produced(c)
        for c in choices
    )


def _engine_gone(answer: Any) -> bool:
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return isinstance(message, str) and message.startswith(_ENGINE_DEAD_MESSAGE)


def refusal(status: int, raw: bytes) -> str | None:
    """Why a whole generation answer (``status``, body ``raw``) is a refusal by a backend that is
    shutting down (``ABORTED``, ``ENGINE_GONE``), or None for any other answer."""
    try:
        answer = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None  # not ours to judge: the leg reports it as it is
    if 200 <= status < 300:
        return ABORTED if refused(answer) else None
    if status == 500:
        return ENGINE_GONE if _engine_gone(answer) else None
    return None


def _generation_error(answer: Any) -> bool:
    error = answer.get("error") if isinstance(answer, dict) else None
    return isinstance(error, dict) and (error.get("message"), error.get("type")) == (
        _GENERATION_ERROR
    )


def failed_before_a_token(status: int, head: bytes) -> bool:
    """Whether a decode's answer read up to its first token (``read_head``: ``status``, the bytes
    ``head``) is vLLM's error for a request that failed before producing one: a whole 500, or a
    stream whose first event is the error. Under ``kv_load_failure_policy`` ``fail`` that is a
    KV load that failed (the prefill holding the KV had gone); nothing reached the client."""
    if status == 500:
        try:
            return _generation_error(msgspec.json.decode(head))
        except msgspec.DecodeError:
            return False
    if not 200 <= status < 300:
        return False
    events, _ = _events(head)
    return bool(events) and _generation_error(events[0])


def _events(head: bytes) -> tuple[list[Any], bool]:
    """The complete SSE events in ``head`` (parsed ``data:`` payloads) and whether ``[DONE]``
    was among them; a payload that is not JSON is kept as None."""
    events: list[Any] = []
    done = False
    for block in head.split(b"\n\n")[:-1]:  # the last piece is an unfinished event
        for line in block.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            try:
                events.append(msgspec.json.decode(data))
            except msgspec.DecodeError:
                events.append(None)
    return events, done


def _stream_verdict(head: bytes, ended: bool) -> bool | None:
    """From the stream read so far: True refused, False real, None not known yet."""
    events, done = _events(head)
    for event in events:
        if not isinstance(event, dict) or "error" in event:
            return False  # an error event is the backend's answer: pass it on
        choices = event.get("choices") or []
        if any(isinstance(c, dict) and _produced(c) for c in choices):
            return False
    if done or ended:
        return True  # ended without a token
    return None


async def read_head(response: http1.Response, role: str, url: str) -> bytes:
    """Read a generation answer far enough to know it is not a refusal by a backend that is
    shutting down; raises BackendDraining when it is one (the response is then released).

    A whole 2xx (JSON) answer is read completely; the response keeps it for ``read()``, and
    the bytes returned are empty. A stream is read up to its first token event (or its end),
    and an error answer up to ``MAX_HEAD_BYTES``: the bytes read are returned, for the caller to
    pass on before the rest of the body.
    """
    if 200 <= response.status < 300 and response.content_type != "text/event-stream":
        if refusal(response.status, await response.read()):
            raise BackendDraining(role, url, ABORTED)
        return b""
    if not 200 <= response.status < 300:
        head = await response.read_some(MAX_HEAD_BYTES)
        if refusal(response.status, head):
            response.release()
            raise BackendDraining(role, url, ENGINE_GONE)
        return head
    head = b""
    while len(head) <= MAX_HEAD_BYTES:
        chunk = await response.read_some()
        head += chunk
        verdict = _stream_verdict(head, ended=not chunk)
        if verdict is False:
            return head
        if verdict is True:
            response.release()
            raise BackendDraining(role, url, ABORTED)
    return head
