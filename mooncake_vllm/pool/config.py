"""The pool's settings: the keys Mooncake Store users already write, validated at startup.

Read from the same sources as the P2P connector's (``MOONCAKE_CONFIG_PATH`` json, then
``kv_connector_extra_config``), into their own model: a pool json holds store keys, not
``prefill_url``/``decode_url``.
"""

from __future__ import annotations

import re
import socket
from typing import Any, ClassVar

from pydantic import Field, field_validator

from mooncake_vllm.core.settings import ConfigError, SharedSettings
from mooncake_vllm.metadata import parse_metadata_server, split_host_port

# The store refuses a mounted segment below this (measured on 0.3.13.post1: setup returns -600,
# "Total size must be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20
_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}
_UNITS.update({"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40})
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"512MB"``/``"3.5 GiB"`` (binary units, as
    Mooncake's own config reader)."""
    if isinstance(value, bool):
        raise ValueError(f"{key}={value!r} must be a byte count, e.g. 536870912 or '512MB'")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"{key}={value!r} must be a byte count, e.g. 536870912 or '512MB'")


class PoolSettings(SharedSettings):
    """Keys of the pool's json (and of ``kv_connector_extra_config``)."""

    connector_name: ClassVar[str] = "MooncakeStoreConnector"

    # mooncake_master's RPC address (its --rpc_port, 50051 by default).
    master_server_address: str
    # Where the store's transfer engines publish their segments: mooncake_master's built-in
    # server (--enable_http_metadata_server: http://<master host>:8080/metadata), etcd or redis.
    metadata_server: str
    local_hostname: str = "127.0.0.1"
    # DRAM this instance mounts into the pool (each worker rank), and its staging buffer.
    global_segment_size: int = 512 << 20
    local_buffer_size: int = 16 << 20
    # MC_TRANSFER_TIMEOUT, a key store users write. The 0.3.13.post1 store does not read it
    # (measured: 5 changed nothing); stall_timeout_s is what ends a stalled get.
    transfer_timeout: int = Field(10, ge=1, le=600)
    # A get (load) not done this long after it started fails, and vLLM's
    # kv_load_failure_policy decides (recompute or fail). 30 s as for P2P pulls: the store's TCP
    # transfers stall now and then for 10-20 s (docs/pool.md), a slow answer beats a failed one.
    load_timeout_s: float = Field(30.0, gt=0)
    # Unset: the engine's own progress deadline (30 s). Set, it becomes MC_TCP_PROGRESS_TIMEOUT_SEC:
    # a stalled get then fails sooner and is asked again, but on 0.3.13.post1 a 2 s deadline left
    # the holder not serving for 13-60 s afterwards in 2 of 2 pool e2e runs (docs/pool.md).
    stall_timeout_s: int | None = Field(None, ge=1, le=60)
    # The scheduler's existence check; past it the prompt counts as a miss (computed here).
    lookup_timeout_s: float = Field(1.0, gt=0, le=30)

    @field_validator("global_segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _sizes(cls, v: Any, info) -> int:
        return parse_size(info.field_name, v)

    @field_validator("global_segment_size")
    @classmethod
    def _segment(cls, v: int) -> int:
        if v < MIN_SEGMENT_BYTES:
            raise ValueError(f"must be at least {MIN_SEGMENT_BYTES} (16 MiB; the store's minimum)")
        return v

    @field_validator("local_buffer_size")
    @classmethod
    def _buffer(cls, v: int) -> int:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("master_server_address")
    @classmethod
    def _master(cls, v: str) -> str:
        if split_host_port(v) is None:
            raise ValueError("must be 'host:port' of mooncake_master, e.g. '127.0.0.1:50051'")
        return v

    @field_validator("metadata_server")
    @classmethod
    def _metadata(cls, v: str) -> str:
        if v == "P2PHANDSHAKE" or (v.partition("://")[1] and parse_metadata_server(v)):
            return v  # parse_metadata_server's ValueError names the accepted forms
        raise ValueError(
            "must be 'http://host:port/metadata' (e.g. mooncake_master "
            "--enable_http_metadata_server), 'etcd://host:port', 'redis://host:port' or "
            "'P2PHANDSHAKE'"
        )

    @property
    def bind_host(self) -> str:
        """``local_hostname`` without a port, if it names one."""
        host_port = split_host_port(self.local_hostname)
        return host_port[0] if host_port else self.local_hostname

    def engine_env(self) -> dict[str, str]:
        """The transfer-engine environment the store's engine reads at setup."""
        env = {
            "MC_TRANSFER_TIMEOUT": str(self.transfer_timeout),
            # Bind and advertise local_hostname, not the machine's first interface: readers
            # connect to the address a holder advertises (as for the P2P connector).
            "MC_TCP_BIND_ADDRESS": self.bind_host,
        }
        if self.protocol == "tcp":
            env["MC_FORCE_TCP"] = "1"
            if self.stall_timeout_s is not None:
                env["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(self.stall_timeout_s)
        return env


def check_reachable(settings: PoolSettings, timeout_s: float = 3.0) -> None:
    """Fail at startup, naming the key, when mooncake_master does not answer (the store's own
    setup would retry for about 90 s and then fail without saying why)."""
    host, port = split_host_port(settings.master_server_address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(
            f"master_server_address={settings.master_server_address!r}: no mooncake_master "
            f"answers there ({e.strerror or e}). Start it (e.g. `mooncake_master --rpc_port "
            f"{port} --enable_http_metadata_server`) or fix the address"
        ) from e
