"""The P2P connector's settings (``MooncakeSettings``, read as ``core.settings`` says) and what
they resolve to for one engine (``ConnectorConfig``: role, addresses, transfer-engine env)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from mooncake_vllm.core.auth import Keys, load_keys
from mooncake_vllm.core.serving_url import normalize_advertise_url
from mooncake_vllm.core.settings import ConfigError, SharedSettings, check_role
from mooncake_vllm.core.settings import load_settings as _load
from mooncake_vllm.metadata import (
    P2P_HANDSHAKE,
    MetadataAuth,
    MetadataTarget,
    check_auth,
    parse_metadata_server,
    split_host_port,
)

Role = Literal["kv_producer", "kv_consumer", "kv_both"]


def _host_port(key: str, value: str) -> tuple[str, int]:
    host_port = split_host_port(value)
    if host_port is None:
        raise ValueError(f"{key}={value!r} must be 'host:port', e.g. '127.0.0.1:13003'")
    return host_port


class MooncakeSettings(SharedSettings):
    """Keys of the Mooncake json (and of ``kv_connector_extra_config``)."""

    # Where this engine's transfer engine and side channel listen: the producer (and kv_both)
    # uses prefill_url, the consumer decode_url. Rank r uses port + 2r (engine) and
    # port + 2r + 1 (side channel), so a same-host pair needs ports 2 * tp_size apart.
    prefill_url: str = "127.0.0.1:13003"
    decode_url: str = "127.0.0.1:13012"
    local_hostname: str | None = Field(
        None, description="address to advertise instead of the url's host"
    )
    # P2PHANDSHAKE, etcd(s)://h:p[,h:p], redis(s)://h:p, http(s)://h:p/metadata (the "s" forms
    # over TLS), or a bare h:p read with metadata_backend (the seed's form); see metadata.targets.
    metadata_server: str = P2P_HANDSHAKE
    metadata_backend: Literal["etcd", "redis", "http"] | None = None
    # Keys an engine publishes in the store expire this long after it stops refreshing them.
    metadata_ttl_s: float = Field(30.0, ge=3)
    # Bytes of KV the producer may hold for consumers that have not pulled yet.
    kv_buffer_size: int = Field(1_000_000_000, gt=0)
    lease_ttl_s: float = Field(30.0, gt=0)
    load_timeout_s: float = Field(30.0, gt=0)
    # Transfer-engine entries one pull keeps in flight (each its own TCP connection).
    max_batch_entries: int = Field(512, gt=0, le=2000)
    # Consumer: staging memory per TP rank for pulls from a producer of another block size
    # (core.reblock), allocated and registered at startup; 0 refuses other block sizes.
    reblock_buffer_bytes: int = Field(64 << 20, ge=0)
    # Producer: open a prompt's lease in its prefill's last step and tell consumers each layer as
    # it is written, so a decode sent with the prefill (the proxy's --dispatch concurrent) pulls
    # while the prefill computes. CPU KV caches only.
    layerwise_handoff: bool = False
    # Producer: the port of the bootstrap HTTP service vLLM's upstream orchestrators ask
    # (``GET /query``, ``p2p.bootstrap``), bound to this engine's host. Unset:
    # VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998 (as upstream). 0: no bootstrap service.
    bootstrap_port: int | None = Field(None, ge=0, le=65535)
    # Producer: 'host:port' where the bootstrap service listens, as vLLM's upstream connector
    # reads it (``get_mooncake_bootstrap_addr``, which Dynamo's prefill worker calls to tell the
    # decode where to ask); it wins over bootstrap_port and the engine's host.
    bootstrap_server_address: str | None = None
    # With a metadata store: the OpenAI base URL published for ``proxy_server.py --discover``.
    # Default: the vLLM API server's --host/--port (see ``serving_url``).
    advertise_url: str | None = None
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

    @field_validator("prefill_url", "decode_url", "bootstrap_server_address")
    @classmethod
    def _check_url(cls, v: str | None, info) -> str | None:
        if v is not None:
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
    base_port: int  # this engine's first port: the url's, after the DP ranks before it
    bootstrap_port: int = 0  # 0: none (a consumer, or turned off)
    bootstrap_host: str = ""  # where it listens: the engine's host unless configured
    # False when the port is upstream's default (nothing set it): taken, the engine starts
    # without a bootstrap service instead of refusing to (a second producer on one host).
    bootstrap_port_set: bool = True
    # vLLM's data parallelism (``--data-parallel-size``): one engine core per DP rank, each with
    # its own connector. On one host the local ranks take consecutive port ranges from the url's
    # port (``2 * tp_size`` ports each); the first local rank serves the bootstrap, and the
    # others register with it (``p2p.bootstrap``).
    dp_rank: int = 0
    dp_local_rank: int = 0
    # vLLM's pipeline parallelism: ``pp_size`` stages of ``tp_size`` workers each; worker rank
    # ``pp_rank * tp_size + tp_rank`` has the ports ``2 * rank`` and ``2 * rank + 1``.
    pp_size: int = 1
    # vLLM's --otlp-traces-endpoint: our spans go there too (``core.tracing``); None: off.
    otlp_traces_endpoint: str | None = None

    @property
    def ranks(self) -> int:
        """This engine's workers: each has a transfer-engine port and a side-channel port."""
        return self.tp_size * self.pp_size

    def rank(self, tp_rank: int, pp_rank: int = 0) -> int:
        return pp_rank * self.tp_size + tp_rank

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def engine_hostname(self, rank: int) -> str:
        """The transfer-engine address of worker ``rank`` (``rank()``)."""
        return f"{self.host}:{self.base_port + 2 * rank}"

    def side_channel_port(self, rank: int) -> int:
        """The side-channel port of worker ``rank`` (``rank()``)."""
        return self.base_port + 2 * rank + 1

    @property
    def serves_bootstrap(self) -> bool:
        """This engine runs the host's bootstrap service (the first local DP rank's does)."""
        return bool(self.bootstrap_port) and self.dp_local_rank == 0

    @property
    def bootstrap_listen_host(self) -> str:
        return self.bootstrap_host or self.host

    @property
    def metadata(self) -> MetadataTarget:
        """Where the transfer-engine metadata lives, legacy bare forms made explicit."""
        return parse_metadata_server(self.settings.metadata_server, self.settings.metadata_backend)

    def engine_env(self) -> dict[str, str]:
        """Every transfer-engine environment setting we choose, with why (the engine reads them
        once, at initialize; it ignores ``protocol``). Listed in docs/configuration.md."""
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


def load_settings(
    extra_config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> MooncakeSettings:
    """The P2P connector's settings from the json file and ``extra_config`` (``core.settings``)."""
    return _load(extra_config, env, model=MooncakeSettings)


def resolve(
    settings: MooncakeSettings,
    role: str | None,
    engine_id: str,
    tp_size: int,
    env: Mapping[str, str] | None = None,
    *,
    dp_rank: int = 0,
    dp_local_rank: int = 0,
    pp_size: int = 1,
) -> ConnectorConfig:
    """``dp_rank``, ``dp_local_rank``: vLLM's data parallel rank of this engine, of all and of
    those on this host (its ports are the url's after the local ranks before it); ``pp_size``:
    its pipeline stages (each of ``tp_size`` workers)."""
    role = check_role(role, "MooncakeConnector")
    own_key = "decode_url" if role == "kv_consumer" else "prefill_url"
    host, port = _host_port(own_key, getattr(settings, own_key))
    workers = tp_size * pp_size
    size = f"tp_size {tp_size}" + (f" × pp_size {pp_size}" if pp_size > 1 else "")
    port += 2 * workers * dp_local_rank
    if port + 2 * workers > 65536:
        raise ConfigError(
            f"{own_key}={getattr(settings, own_key)!r}: port too high for {size} "
            f"at local DP rank {dp_local_rank}"
        )
    p_host, p_port = _host_port("prefill_url", settings.prefill_url)
    d_host, d_port = _host_port("decode_url", settings.decode_url)
    if p_host == d_host and abs(p_port - d_port) < 2 * workers:
        raise ConfigError(
            f"prefill_url={settings.prefill_url!r} and decode_url={settings.decode_url!r} are on "
            f"one host and each side uses {2 * workers} ports from its url's port ({size}); put "
            f"the ports at least {2 * workers} apart"
        )
    return ConnectorConfig(
        settings=settings,
        role=role,  # type: ignore[arg-type]
        engine_id=engine_id,
        tp_size=tp_size,
        host=settings.local_hostname or host,
        base_port=port,
        **_bootstrap_address(settings, env, role),
        dp_rank=dp_rank,
        dp_local_rank=dp_local_rank,
        pp_size=pp_size,
    )


BOOTSTRAP_PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
DEFAULT_BOOTSTRAP_PORT = 8998  # upstream's


def _bootstrap_address(
    settings: MooncakeSettings, env: Mapping[str, str] | None, role: str
) -> dict[str, Any]:
    if role == "kv_consumer":
        return {"bootstrap_port": 0}
    if settings.bootstrap_server_address is not None:
        host, port = _host_port("bootstrap_server_address", settings.bootstrap_server_address)
        return {"bootstrap_port": port, "bootstrap_host": host}
    port = bootstrap_port(settings, env)
    chosen = settings.bootstrap_port is not None or bool(
        (os.environ if env is None else env).get(BOOTSTRAP_PORT_ENV)
    )
    return {"bootstrap_port": port, "bootstrap_port_set": chosen}


def bootstrap_port(settings: MooncakeSettings, env: Mapping[str, str] | None = None) -> int:
    """The producer's bootstrap port: ``bootstrap_port``, else ``VLLM_MOONCAKE_BOOTSTRAP_PORT``
    (the variable vLLM's upstream connector and its orchestrators read), else 8998."""
    if settings.bootstrap_port is not None:
        return settings.bootstrap_port
    raw = (os.environ if env is None else env).get(BOOTSTRAP_PORT_ENV)
    if raw is None or raw == "":
        return DEFAULT_BOOTSTRAP_PORT
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(
            f"{BOOTSTRAP_PORT_ENV}={raw!r} must be a port number 0-65535 (0: no bootstrap "
            "service); or set bootstrap_port in kv_connector_extra_config, which wins"
        )
    return port
