"""Settings both connectors read the same way: one json file (``MOONCAKE_CONFIG_PATH``), then
``kv_connector_extra_config`` (which wins), validated into a pydantic model at startup. Every
problem is a ``ConfigError`` naming the key, the bad value and the accepted forms, so a bad config
never surfaces mid-request. ``SharedSettings`` holds the keys both connectors accept.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mooncake_vllm.metadata import redact_url

ROLES = ("kv_producer", "kv_consumer", "kv_both")


CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
Role = Literal["kv_producer", "kv_consumer", "kv_both"]


class ConfigError(ValueError):
    """A configuration problem, worded for the user who wrote the config."""


class SharedSettings(BaseModel):
    """The keys of both connectors' configs (each adds its own)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""
    # A TCP transfer that makes no progress for this long is dropped by the transfer engine
    # (MC_TCP_PROGRESS_TIMEOUT_SEC; whole seconds, the engine's unit; its own default is 30), so
    # it fails, can no longer write, and is asked again while the load's deadline allows: P2P
    # reads the entry again, the pool asks the master again (a fresh lease).
    stall_timeout_s: int = Field(2, ge=1, le=60)
    # Seconds vLLM's queue readers in this engine busy-wait after a message (vLLM: 1 s);
    # null keeps vLLM's. See ``vllm_glue``. Not below 20 ms: at 0 a reader that misses a wake-up
    # waits for vLLM's 5 s recheck (measured: 32 tokens took 155 s); shorter is unmeasured.
    vllm_busy_loop_s: float | None = Field(0.02, ge=0.02, le=1)
    # Model identity in the compatibility check (P2P) and the pool keys' salt: by default a
    # fingerprint of the model's files; set it when engines load the same weights from files that
    # differ (a declared name, the same everywhere).
    model_identity: str | None = None
    # Run on a vLLM outside the tested versions, or one whose internals moved, with plain
    # fallbacks (``vllm_glue``); otherwise such a vLLM stops at startup, naming what changed.
    allow_untested_vllm: bool = False
    # Priority of our latency-critical threads (``core.os_threads``): off, nice, or realtime
    # (SCHED_FIFO where the process may take it). The default touches no other process's share.
    thread_priority: Literal["off", "nice", "realtime"] = "nice"


def check_role(role: str | None, connector: str) -> str:
    if role not in ROLES:
        raise ConfigError(
            f"kv_role={role!r}: {connector} accepts 'kv_producer', 'kv_consumer' or 'kv_both'"
        )
    return role


def _format_validation_error(err: ValidationError, source: str, model: type[BaseModel]) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(config)"
        if e["type"] == "extra_forbidden":
            accepted = ", ".join(model.model_fields)
            lines.append(f"unknown key {key!r} (accepted keys: {accepted})")
        elif not e["loc"]:  # a check across keys: its message names them
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            if isinstance(value, str):
                value = redact_url(value)  # a store URL may carry a password
            lines.append(f"{key}={value!r}: {msg}")
    name = getattr(model, "connector_name", "MooncakeConnector")
    return f"invalid {name} config ({source}): " + "; ".join(lines)


def load_settings(
    extra_config: Mapping[str, Any] | None,
    env: Mapping[str, str] | None = None,
    *,
    model: type[BaseModel],
) -> Any:
    """Merge the json file (if ``MOONCAKE_CONFIG_PATH`` is set) with extra_config and validate
    into ``model`` (the P2P connector's ``MooncakeSettings``, the pool's ``PoolSettings``)."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    sources = []
    path = env.get(CONFIG_PATH_ENV)
    if path:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(
                f"{CONFIG_PATH_ENV}={path!r} cannot be read ({e.strerror}); point it to a "
                "readable Mooncake json file, or unset it and use kv_connector_extra_config"
            ) from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            # json files are UTF-8 (RFC 8259); other bytes are a config problem, not a crash.
            raise ConfigError(f"{CONFIG_PATH_ENV}={path!r} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{CONFIG_PATH_ENV}={path!r} must hold a JSON object")
        merged.update(data)
        sources.append(path)
    merged.update(extra_config or {})
    if extra_config:
        sources.append("kv_connector_extra_config")
    try:
        return model(**merged)
    except ValidationError as e:
        source = " + ".join(sources) or "defaults"
        # Not chained: pydantic's own error shows every input, a URL's password included.
        raise ConfigError(_format_validation_error(e, source, model)) from None
