"""The proxy's configuration: one frozen pydantic model, validated once at startup.

Field names match the command-line flags (``timeout_s`` is ``--timeout-s``), so a validation error
names the flag the user typed (see ``server.parse_args``).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mooncake_vllm.metadata import parse_metadata_server
from mooncake_vllm.proxy.http_servers import DEFAULT_HTTP_SERVER, HttpServer
from mooncake_vllm.proxy.routing import Policy

LogLevel = Literal["debug", "info", "warning", "error", "critical"]


def normalize_backend_url(url: str) -> str:
    """``http(s)://HOST[:PORT]`` without a trailing slash; raises ValueError otherwise."""
    expected = "expected http://HOST:PORT or https://HOST:PORT"
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError as e:
        raise ValueError(f"{url!r} is not a backend URL ({e}); {expected}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not a backend URL; {expected}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(
            f"{url!r} has a path, query or credentials; {expected} (the proxy adds /v1/...)"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


class ProxyConfig(BaseModel):
    """Everything the proxy needs; field names match the CLI flags (``--timeout-s``...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Static backends; with ``discover`` either may be empty (the registry fills the pools).
    prefill: list[str] = []
    decode: list[str] = []
    # A metadata store (etcd://, redis://, http://) whose engine registry the pools follow.
    discover: str | None = None
    discover_interval_s: float = Field(1.0, gt=0)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    policy: Policy = Policy.ROUND_ROBIN
    server: HttpServer = DEFAULT_HTTP_SERVER
    # p2p: the prefill hands its KV to the decode through kv_transfer_params (MooncakeConnector).
    # pool: nothing is handed over; the decode finds the prompt in the pool by its tokens
    # (MooncakeStoreConnector), as behind Mooncake guide's minimal proxy.
    mode: Literal["p2p", "pool"] = "p2p"
    api_key: str | None = None
    timeout_s: float = Field(300.0, gt=0)
    prefill_timeout_s: float = Field(120.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    health_interval_s: float = Field(5.0, gt=0)
    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0)
    log_level: LogLevel = "info"

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        normalized = [normalize_backend_url(u) for u in urls]
        duplicates = sorted({u for u in normalized if normalized.count(u) > 1})
        if duplicates:
            raise ValueError(f"listed more than once: {', '.join(duplicates)}")
        return normalized

    @field_validator("discover")
    @classmethod
    def _discover(cls, url: str | None) -> str | None:
        if url is None:
            return None
        if parse_metadata_server(url).kind == "p2p":  # ValueError names the accepted forms
            raise ValueError("P2PHANDSHAKE has no registry; give etcd://, redis:// or http://")
        return url

    @model_validator(mode="after")
    def _some_backends(self) -> ProxyConfig:
        if self.discover is None:
            missing = [f"--{role}" for role in ("prefill", "decode") if not getattr(self, role)]
            if missing:
                raise ValueError(
                    f"no {' and no '.join(missing)} backend: give {' and '.join(missing)} URL, "
                    "or --discover etcd://HOST:PORT (or redis://, http://) to find them"
                )
        return self

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, key: str | None) -> str | None:
        if key is not None and not key.strip():
            raise ValueError("must not be empty")
        return key
