"""The connector's settings: one typed object, built once at startup.

Sources, later wins: the Mooncake-format json named by ``MOONCAKE_CONFIG_PATH``, then
``kv_connector_extra_config``. Every problem is raised at startup as a ``ConfigError`` naming the
key, the bad value and the accepted forms, so a bad config never surfaces mid-request.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from mooncake_vllm.auth import Keys, load_keys
from mooncake_vllm.metadata import (
    P2P_HANDSHAKE,
    MetadataAuth,
    MetadataTarget,
    check_auth,
    parse_metadata_server,
    redact_url,
    split_host_port,
)
from mooncake_vllm.serving_url import normalize_advertise_url

CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
Role = Literal["kv_producer", "kv_consumer", "kv_both"]


class ConfigError(ValueError):
    """A configuration problem, worded for the user who wrote the config."""


def _host_port(key: str, value: str) -> tuple[str, int]:
    host_port = split_host_port(value)
    if host_port is None:
        raise ValueError(f"{key}={value!r} must be 'host:port', e.g. '127.0.0.1:13003'")
    return host_port


class MooncakeSettings(BaseModel):
    """Keys of the Mooncake json (and of ``kv_connector_extra_config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Where this engine's transfer engine and side channel listen: the producer (and kv_both)
    # uses prefill_url, the consumer decode_url. Rank r uses port + 2r (engine) and
    # port + 2r + 1 (side channel), so a same-host pair needs ports 2 * tp_size apart.
    prefill_url: str = "127.0.0.1:13003"
    decode_url: str = "127.0.0.1:13012"
    local_hostname: str | None = Field(
        None, description="address to advertise instead of the url's host"
    )
    # P2PHANDSHAKE, etcd(s)://h:p[,h:p], redis(s)://h:p, http(s)://h:p/metadata (the "s" forms
    # over TLS), or a bare h:p read with metadata_backend (the seed's form). See ``metadata``.
    metadata_server: str = P2P_HANDSHAKE
    metadata_backend: Literal["etcd", "redis", "http"] | None = None
    # Keys an engine publishes in the store expire this long after it stops refreshing them.
    metadata_ttl_s: float = Field(30.0, ge=3)
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""
    # Bytes of KV the producer may hold for consumers that have not pulled yet.
    kv_buffer_size: int = Field(1_000_000_000, gt=0)
    lease_ttl_s: float = Field(30.0, gt=0)
    load_timeout_s: float = Field(30.0, gt=0)
    # A transfer-engine entry (one region, one TCP connection) that makes no progress for this
    # long is dropped by the engine and read again (whole seconds: the engine's unit).
    stall_timeout_s: int = Field(2, ge=1, le=60)
    # Transfer-engine entries one pull keeps in flight (each its own TCP connection).
    max_batch_entries: int = Field(512, gt=0, le=2000)
    # With a metadata store: the OpenAI base URL published for ``proxy_server.py --discover``.
    # Default: the vLLM API server's --host/--port (see ``serving_url``).
    advertise_url: str | None = None
    # Seconds vLLM's queue readers in this engine busy-wait after a message (vLLM: 1 s);
    # null keeps vLLM's. See ``vllm_glue``. Not below 20 ms: at 0 a reader that misses a wake-up
    # waits for vLLM's 5 s recheck (measured: 32 tokens took 155 s); shorter is unmeasured.
    vllm_busy_loop_s: float | None = Field(0.02, ge=0.02, le=1)
    # Python's switch interval in this engine's worker processes (Python: 5 ms); null keeps it.
    # A pull thread waits up to this long for the GIL at each poll while vLLM's reader spins.
    gil_switch_interval_s: float | None = Field(0.0002, gt=0, le=0.1)
    # ---- trust (docs/security.md) ----
    # The shared secret that authenticates side-channel frames and metadata-store records: a
    # file, or the name of an environment variable (never the secret itself). Unset: off.
    auth_secret_file: str | None = None
    auth_secret_env: str | None = None
    # Consumer: the producers it may pull from (IPs, CIDRs, host names), checked against the
    # handoff's side channel and the granted transfer-engine segment. Unset: any producer (with a
    # secret, only producers holding it can answer).
    trusted_producers: list[str] | None = None
    # Producer: what one side-channel peer may send, and how many peers are tracked at once.
    side_channel_max_frame_bytes: int = Field(1 << 20, ge=4096)
    side_channel_peer_rate: float = Field(2000.0, gt=0)  # frames per second, with a burst of 2 s
    side_channel_max_peers: int = Field(256, ge=1)
    # Credentials for the metadata store (etcd, redis, http), read from files or the environment.
    metadata_auth: MetadataAuth = MetadataAuth()
    # Model identity in the compatibility check: by default a fingerprint of the model's files;
    # set it when both sides load the same weights from files that differ (a declared name).
    model_identity: str | None = None
    # Run on a vLLM outside the tested versions, or one whose internals moved, with plain
    # fallbacks (``vllm_glue``); otherwise such a vLLM stops at startup, naming what changed.
    allow_untested_vllm: bool = False
    # Priority of our latency-critical threads (``os_threads``): off, nice, or realtime (SCHED_FIFO
    # where the process may take it). The default touches no other process's share of a host.
    thread_priority: Literal["off", "nice", "realtime"] = "nice"

    @field_validator("prefill_url", "decode_url")
    @classmethod
    def _check_url(cls, v: str, info) -> str:
        _host_port(info.field_name, v)
        return v

    @field_validator("advertise_url")
    @classmethod
    def _check_advertise_url(cls, v: str | None) -> str | None:
        return None if v is None else normalize_advertise_url(v)

    @field_validator("trusted_producers")
    @classmethod
    def _check_trusted(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("an empty list trusts no producer; drop the key to trust any")
        return v

    @model_validator(mode="after")
    def _check_secret(self) -> MooncakeSettings:
        load_keys(self.auth_secret_file, self.auth_secret_env)
        return self

    def auth_keys(self) -> Keys:
        """The shared secret's keys (``()``: authentication off); checked at startup."""
        return load_keys(self.auth_secret_file, self.auth_secret_env)

    @model_validator(mode="after")
    def _check_metadata(self) -> MooncakeSettings:
        target = parse_metadata_server(self.metadata_server, self.metadata_backend)
        check_auth(target, self.metadata_auth)
        if self.advertise_url is not None and target.kind == "p2p":
            raise ValueError(
                f"advertise_url={self.advertise_url!r} is published in a metadata store, and "
                f"metadata_server={self.metadata_server!r} is none: set metadata_server to "
                "'etcd://h:p', 'redis://h:p' or 'http://h:p/metadata', or drop advertise_url"
            )
        return self


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings resolved for one engine: its role, addresses and transfer-engine arguments."""

    settings: MooncakeSettings
    role: Role
    engine_id: str
    tp_size: int
    host: str
    base_port: int

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def engine_hostname(self, tp_rank: int) -> str:
        return f"{self.host}:{self.base_port + 2 * tp_rank}"

    def side_channel_port(self, tp_rank: int) -> int:
        return self.base_port + 2 * tp_rank + 1

    @property
    def metadata(self) -> MetadataTarget:
        """Where the transfer-engine metadata lives, legacy bare forms made explicit."""
        return parse_metadata_server(self.settings.metadata_server, self.settings.metadata_backend)

    def engine_env(self) -> dict[str, str]:
        """Every transfer-engine environment setting we choose, with why (the engine reads them
        once, at initialize; it ignores ``protocol``). Listed in the README."""
        env = {
            # Bind and advertise the configured address, not the machine's first interface.
            "MC_TCP_BIND_ADDRESS": self.host,
            # Drop an entry's connection after this long without progress, so a stalled read
            # ends (and is retried) instead of hanging 30 s; a dropped one can no longer write.
            "MC_TCP_PROGRESS_TIMEOUT_SEC": str(self.settings.stall_timeout_s),
        }
        if self.settings.protocol == "tcp":
            env["MC_FORCE_TCP"] = "1"  # the engine's only transport switch
        if self.metadata.kind != "p2p":
            # With a store, a restarted peer re-registers under the same name: refresh cached
            # peer metadata so its new descriptor is picked up. Not with P2P handshake: there a
            # restarted peer gets a new name (a new RPC port), and the periodic sync asks the
            # peer itself: a 24 s sync was once seen beside a read from that peer hung for 30 s.
            env["MC_TE_METADATA_REFRESH_INTERVAL_SECONDS"] = os.environ.get(
                "MC_TE_METADATA_REFRESH_INTERVAL_SECONDS", "5"
            )
        return env


def _format_validation_error(
    err: ValidationError, source: str, model: type[BaseModel] = MooncakeSettings
) -> str:
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
    model: type[BaseModel] = MooncakeSettings,
) -> Any:
    """Merge the json file (if ``MOONCAKE_CONFIG_PATH`` is set) with extra_config and validate
    into ``model`` (``MooncakeSettings``; the pool passes its ``PoolSettings``)."""
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


def resolve(
    settings: MooncakeSettings,
    role: str | None,
    engine_id: str,
    tp_size: int,
) -> ConnectorConfig:
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(
            f"kv_role={role!r}: MooncakeConnector accepts 'kv_producer', 'kv_consumer' or 'kv_both'"
        )
    own_key = "decode_url" if role == "kv_consumer" else "prefill_url"
    host, port = _host_port(own_key, getattr(settings, own_key))
    if port + 2 * tp_size > 65536:
        raise ConfigError(f"{own_key}={getattr(settings, own_key)!r}: port too high for tp_size")
    p_host, p_port = _host_port("prefill_url", settings.prefill_url)
    d_host, d_port = _host_port("decode_url", settings.decode_url)
    if p_host == d_host and abs(p_port - d_port) < 2 * tp_size:
        raise ConfigError(
            f"prefill_url={settings.prefill_url!r} and decode_url={settings.decode_url!r} are on "
            f"one host and each side uses {2 * tp_size} ports from its url's port; put the ports "
            f"at least {2 * tp_size} apart"
        )
    return ConnectorConfig(
        settings=settings,
        role=role,  # type: ignore[arg-type]
        engine_id=engine_id,
        tp_size=tp_size,
        host=settings.local_hostname or host,
        base_port=port,
    )
