"""Pure request rewriting: validate a client body and build the prefill and decode legs.

Nothing here does I/O; ``legs.py`` and ``app.py`` call these functions and send what they
return. The contract with the connector lives in two functions:

- ``build_prefill_body`` asks the prefill vLLM for one token and tells its connector, through
  ``kv_transfer_params``, to keep the KV blocks for a remote decode under a fresh ``transfer_id``;
- ``build_decode_body`` hands the decode vLLM exactly the ``kv_transfer_params`` the prefill
  answered with, so the decode connector pulls those blocks instead of computing the prompt.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import msgspec

# msgspec's JSON: strict (no NaN/Infinity, which json.dumps would send on as invalid JSON) and
# several times faster than the json module on the bodies the proxy parses and writes per request.
_decode_json = msgspec.json.decode
encode_json = msgspec.json.encode

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"

KV_TRANSFER_PARAMS = "kv_transfer_params"

# Longest client X-Request-Id we pass on; vLLM uses it to build its own request id and logs it.
_MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:/+=@-]+")
_MAX_BACKEND_DETAIL_CHARS = 2000


class InvalidRequest(ValueError):
    """A client body the proxy refuses before any backend sees it; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def openai_error(
    message: str,
    error_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """The error body OpenAI clients know how to read."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# ---- client body --------------------------------------------------------------------------------


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decode a client body into a JSON object; raises InvalidRequest when it is not one."""
    try:
        body = _decode_json(raw)
    except msgspec.MsgspecError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_prompt(prompt: Any) -> None:
    accepted = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(f"'prompt' must be {accepted}", "prompt")
    if all(isinstance(p, str) for p in prompt) or all(_is_int(t) for t in prompt):
        return
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return
    raise InvalidRequest(f"'prompt' must be {accepted}", "prompt")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of message objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(
                f"'messages[{i}]' must be an object, got {type(message).__name__}", "messages"
            )


def validate_body(body: dict[str, Any], path: str) -> None:
    """Check the fields the proxy relies on; raises InvalidRequest naming the first bad field.

    ``null`` counts as absent for the optional fields, as in the OpenAI API. Everything else is
    left to vLLM, which answers with its own 400 on the prefill leg.
    """
    if path == COMPLETIONS_PATH:
        if body.get("prompt") is None:
            if body.get("prompt_embeds") is None:
                raise InvalidRequest("'prompt' is required", "prompt")
        else:
            _check_prompt(body["prompt"])
    elif path == CHAT_COMPLETIONS_PATH:
        if "messages" not in body:
            raise InvalidRequest("'messages' is required", "messages")
        _check_messages(body["messages"])
    else:
        raise ValueError(f"not a generation path: {path!r}")

    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        # vLLM answers a completion with max_tokens 0 and echo with the prompt alone.
        least = 0 if key == "max_tokens" and path == COMPLETIONS_PATH and body.get("echo") else 1
        if not (_is_int(value) and value >= least):
            raise InvalidRequest(f"'{key}' must be an integer >= {least}, got {value!r}", key)
    n = body.get("n")
    if n is not None and not (_is_int(n) and n >= 1):
        raise InvalidRequest(f"'n' must be an integer >= 1, got {n!r}", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be true or false, got {stream!r}", "stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, got {model!r}", "model")


def wants_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True


# ---- the two legs -------------------------------------------------------------------------------


def new_transfer_id() -> str:
    return os.urandom(16).hex()  # as unique as uuid4().hex, without building a UUID


def without_client_handoff(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of the client body without ``kv_transfer_params``: only a prefill may supply them."""
    return {k: v for k, v in body.items() if k != KV_TRANSFER_PARAMS}


# What the prefill leg leaves out of the client's request. The prefill computes the prompt and
# returns one token nobody reads, so it keeps every field that shapes the prompt (prompt or
# messages, chat template and its arguments, tools, add_special_tokens, truncation, suffix, ...)
# or that vLLM checks up front (sampling settings, logit_bias, stop, seed, ...), and drops what
# only asks for work on that token or for a stream:
# - min_tokens: vLLM refuses min_tokens > max_tokens, and the leg's max_tokens is 1;
# - logprobs, top_logprobs, logprob_token_ids: log-probabilities of the discarded token;
# - echo, prompt_logprobs: requests that need the prompt's log-probabilities never get here
#   (``served_by_decode_alone``); echo alone only repeats the prompt in the answer;
# - structured_outputs, and on /v1/completions response_format: a grammar compiled and applied
#   for one token. A chat keeps response_format: a chat template may render it into the prompt.
_PREFILL_LEAVES_OUT = {
    COMPLETIONS_PATH: (
        "min_tokens", "logprobs", "logprob_token_ids", "echo", "prompt_logprobs",
        "structured_outputs", "response_format",
    ),
    CHAT_COMPLETIONS_PATH: (
        "min_tokens", "logprobs", "top_logprobs", "logprob_token_ids", "echo", "prompt_logprobs",
        "structured_outputs",
    ),
}  # fmt: skip


def build_prefill_body(body: dict[str, Any], path: str, transfer_id: str | None) -> dict[str, Any]:
    """The prefill leg: one token, one choice, no stream, and a request to keep the KV for decode.

    The fields in ``_PREFILL_LEAVES_OUT`` are dropped; ``stream_options`` too when the client
    streams (vLLM refuses it without ``stream``; a client that sends it without streaming gets
    vLLM's refusal from the prefill, as from a plain vLLM). Each prefill attempt gets its own
    ``transfer_id``; ``transfer_id`` None (pool mode): no handoff is asked for, the prefill only
    fills the pool.
    """
    leg = without_client_handoff(body)
    for key in _PREFILL_LEAVES_OUT[path]:
        leg.pop(key, None)
    if wants_stream(body):
        leg.pop("stream_options", None)
    leg["max_tokens"] = 1
    if path == CHAT_COMPLETIONS_PATH or "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg["n"] = 1
    if transfer_id is None:
        return leg
    leg[KV_TRANSFER_PARAMS] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return leg


def served_by_decode_alone(body: dict[str, Any], path: str) -> str | None:
    """The field for which the decode serves this request alone, without a prefill leg, or None.

    These are requests whose decode would read no KV by transfer anyway, so a prefill leg
    would only compute the prompt twice and hold blocks nobody pulls:

    - the prompt's log-probabilities (``prompt_logprobs``; ``echo`` with ``logprobs``, or on a
      chat ``echo`` unless ``top_logprobs`` is null, which vLLM turns into prompt
      log-probabilities): they need the logits of every prompt position, so vLLM reads no cached
      or transferred KV for such a request;
    - ``use_beam_search``: vLLM's beam search sends its own engine requests, one per beam and
      step, without the request's ``kv_transfer_params``;
    - ``prompt_embeds``: the pair's handover of embedded prompts is not tested.
    """
    if body.get("use_beam_search"):
        return "use_beam_search"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if body.get("echo"):
        if path == COMPLETIONS_PATH and body.get("logprobs") is not None:
            return "echo"
        if path == CHAT_COMPLETIONS_PATH and body.get("top_logprobs", 0) is not None:
            return "echo"
    if path == COMPLETIONS_PATH and body.get("prompt_embeds") is not None:
        return "prompt_embeds"
    return None


def handoff_from_prefill(answer: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` object at the top level of a prefill answer, or None."""
    if not isinstance(answer, dict):
        return None
    params = answer.get(KV_TRANSFER_PARAMS)
    return params if isinstance(params, dict) else None


def decode_json(raw: bytes) -> Any:
    """A backend's JSON answer; raises ValueError when it is not JSON."""
    try:
        return _decode_json(raw)
    except msgspec.MsgspecError as e:
        raise ValueError(str(e)) from e


def decode_body_bytes(raw: bytes, body: dict[str, Any], handoff: dict[str, Any] | None) -> bytes:
    """``build_decode_body`` as JSON bytes, reusing the client's bytes when it can.

    The client's body passes through as sent, with the handoff spliced in before its closing
    brace: a large prompt is not serialised again. Only a body carrying its own
    ``kv_transfer_params`` (which must not reach the decode) is rebuilt.
    """
    if KV_TRANSFER_PARAMS in body:
        return encode_json(build_decode_body(body, handoff))
    if handoff is None:
        return raw
    # parse_body accepted a non-empty JSON object (validate_body requires prompt or messages),
    # so the last non-blank byte is its closing brace and a member precedes it.
    end = raw.rstrip().rindex(b"}")
    return raw[:end] + b',"' + KV_TRANSFER_PARAMS.encode() + b'":' + encode_json(handoff) + b"}"


def build_decode_body(body: dict[str, Any], handoff: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's request as sent, plus the prefill's handoff when there is one.

    Without a handoff the decode computes the prompt itself: slower, but the answer is the same.
    """
    leg = without_client_handoff(body)
    if handoff is not None:
        leg[KV_TRANSFER_PARAMS] = handoff
    return leg


# ---- headers ------------------------------------------------------------------------------------


def request_id_from(client_value: str | None) -> str:
    """The client's X-Request-Id when it is short and printable, else a new one."""
    if (
        client_value
        and len(client_value) <= _MAX_REQUEST_ID_CHARS
        and _REQUEST_ID_PATTERN.fullmatch(client_value)
    ):
        return client_value
    return os.urandom(16).hex()


def backend_headers(
    *,
    request_id: str,
    client_authorization: str | None,
    forward_client_authorization: bool,
    env_api_key: str | None,
    backend_trusted: bool,
) -> dict[str, str]:
    """Headers for a leg sent to a backend (``backend_trusted``: see ``routing.Backend.trusted``).

    The client's Authorization goes through unless the proxy checks its own key
    (``forward_client_authorization=False``): that key is the proxy's, not the backends'. In
    either case ``OPENAI_API_KEY`` (``env_api_key``) fills in when nothing else is sent. A backend
    the proxy does not trust (discovered, its record not verified) gets neither: anyone who can
    write to the registry could otherwise collect the clients' keys and the backends' key.
    """
    headers = {"X-Request-Id": request_id}
    if not backend_trusted:
        return headers
    if forward_client_authorization and client_authorization:
        headers["Authorization"] = client_authorization
    elif env_api_key:
        headers["Authorization"] = f"Bearer {env_api_key}"
    return headers


# ---- backend answers ----------------------------------------------------------------------------


def backend_error_body(leg: str, status: int, raw: bytes) -> dict[str, Any]:
    """What the client gets for a backend's non-2xx answer.

    An OpenAI error body (an object with an ``error`` key, as vLLM sends) passes unchanged; any
    other answer is wrapped, keeping its ``message`` or text as detail.
    """
    try:
        answer = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        answer = None
    if isinstance(answer, dict) and "error" in answer:
        return answer
    if isinstance(answer, dict) and isinstance(answer.get("message"), str):
        detail = answer["message"]
        error_type = answer.get("type") if isinstance(answer.get("type"), str) else None
    else:
        detail = raw.decode("utf-8", errors="replace").strip()
        error_type = None
    detail = detail[:_MAX_BACKEND_DETAIL_CHARS] or "(empty body)"
    fallback_type = "invalid_request_error" if status < 500 else "backend_error"
    return openai_error(
        f"{leg} backend answered HTTP {status}: {detail}", error_type or fallback_type
    )


def sse_error_event(message: str, error_type: str) -> bytes:
    """A final server-sent event telling a streaming client its answer was cut short."""
    return b"data: " + json.dumps(openai_error(message, error_type)).encode() + b"\n\n"
