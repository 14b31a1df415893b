"""The JSON types of every ``kv_transfer_params`` field the connector reads, in both conventions.

``kv_transfer_params`` reaches the scheduler half as whatever JSON a client sent to the engine's
OpenAI API (vLLM types it ``dict[str, Any]`` and nothing more). Our hooks run inside vLLM's
``schedule()``, which has no handler around them: a field of the wrong type used as a dict key
or compared with a number would raise there and end the engine core, and with it every request
on that engine. So the first hook that sees a request checks every field it will read here,
before anything uses them, and a request whose fields do not type-check is refused through
vLLM's ``kv_load_failure_policy`` (consumer) or not handed over (producer), with the message
naming the field.

``None`` stands for an absent field: clients of both conventions send ``null`` for the ones
they do not use.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ParamTypes(msgspec.Struct, kw_only=True):
    """The fields ``protocol.Handoff``, ``protocol.PendingHandoff`` and upstream's convention
    (``p2p.upstream``) read; unknown fields are left to whoever reads them."""

    do_remote_prefill: bool | None = None
    do_remote_decode: bool | None = None
    pending: bool | None = None
    version: int | None = None
    transfer_id: str | None = None
    producer_engine_id: str | None = None
    side_channel_host: str | None = None
    side_channel_ports: list[int] | None = None
    producer_tp_size: int | None = None
    producer_pp_size: int | None = None
    remote_block_ids: list[int] | None = None
    group_block_ids: list[list[int]] | None = None
    prompt_len: int | None = None
    block_size: int | None = None
    compat_hash: str | None = None
    kv_layout: str | None = None
    kv_format: str | None = None
    producer_incarnation: str | None = None
    prompt_digest: str | None = None
    bootstrap_addr: str | None = None
    # vLLM's upstream MooncakeConnector convention (the decode leg).
    remote_engine_id: str | None = None
    remote_bootstrap_addr: str | None = None


def param_type_error(params: object) -> str | None:
    """What is wrongly typed in ``params`` (one message naming the field and the type it must
    have), or None when every field the connector reads has its JSON type."""
    if not isinstance(params, dict):
        return f"kv_transfer_params must be a JSON object, got {type(params).__name__}"
    try:
        msgspec.convert(params, ParamTypes)
    except msgspec.ValidationError as e:
        # msgspec says e.g. "Expected `str | null`, got `object` - at `$.transfer_id`".
        return f"kv_transfer_params field has the wrong type: {e}"
    return None


def asks_remote_prefill(params: Any) -> bool:
    """The request asks this consumer to load its prompt's KV: ``do_remote_prefill`` is there and
    not false or null. A wrongly typed value counts as asking, so that it is refused through
    the policy (``param_type_error``) instead of being computed here unnoticed."""
    if not isinstance(params, dict):
        return False
    flag = params.get("do_remote_prefill")
    return flag is not None and flag is not False


def asks_remote_decode(params: Any) -> bool:
    """The request asks this producer to hand its prompt's KV over (``do_remote_decode``, as
    ``asks_remote_prefill``)."""
    if not isinstance(params, dict):
        return False
    flag = params.get("do_remote_decode")
    return flag is not None and flag is not False
