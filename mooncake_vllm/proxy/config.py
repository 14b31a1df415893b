"""The proxy's configuration: one frozen pydantic model, validated once at startup.

Field names match the command-line flags (``timeout_s`` is ``--timeout-s``), so a validation error
names the flag the user typed (see ``server.parse_args``). Secrets (the clients' API key, the
shared secret, the metadata store's credentials) are named by a file or an environment variable;
the files are read when the config is validated, so a missing one stops the proxy at startup.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mooncake_vllm.core import auth
from mooncake_vllm.metadata import MetadataAuth, check_auth, parse_metadata_server
from mooncake_vllm.proxy.http_servers import DEFAULT_HTTP_SERVER, HttpServer, check_installed
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
    # How long discovered backends stay after the store returned from an outage or emptied
    # (``discovery``): longer than the engines' heartbeat, a third of their metadata_ttl_s.
    discover_grace_s: float = Field(15.0, ge=0)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    policy: Policy = Policy.ROUND_ROBIN
    # Where each backend publishes its KV events, as BACKEND_URL=tcp://HOST:PORT (--policy kv).
    kv_events: list[str] = []
    # --policy kv: the tokenizer of text and chat prompts (a model path or name); None: the
    # model the engines serve (``proxy.tokens``).
    tokenizer: str | None = None
    server: HttpServer = DEFAULT_HTTP_SERVER
    # p2p: the prefill hands its KV to the decode through kv_transfer_params (MooncakeConnector).
    # pool: nothing is handed over; the decode finds the prompt in the pool by its tokens
    # (MooncakeStoreConnector), as behind Mooncake guide's minimal proxy.
    mode: Literal["p2p", "pool"] = "p2p"
    # sequential: the decode request goes out once the prefill has answered. concurrent: both
    # at once; the decode waits for the KV without stepping (``proxy.concurrent``). p2p only.
    dispatch: Literal["sequential", "concurrent"] = "sequential"
    # Under concurrent dispatch, a request whose prefill is expected to answer later than this
    # (the prompt bytes in flight there at its recent time per byte) goes sequentially: a decode
    # waiting on a deep prefill queue would hold its blocks and run into its load_timeout_s.
    concurrent_max_wait_s: float = Field(10.0, gt=0)
    # The clients' API key: the key itself (shows in process arguments), a file (one key per
    # line: any of them is accepted) or the name of an environment variable; at most one.
    api_key: str | None = None
    api_key_file: str | None = None
    api_key_env: str | None = None
    # /metrics and /health ask for the API key too (off: monitoring and probes need none).
    protect_metrics: bool = False
    protect_health: bool = False
    # Per-client limits on /v1/* (``limits``): requests in flight, requests/s with a burst.
    client_max_concurrency: int | None = Field(None, ge=1)
    client_rate: float | None = Field(None, gt=0)
    client_burst: int | None = Field(None, ge=1)
    # The shared secret registry records are signed with (the connector's auth_secret_file /
    # auth_secret_env): with it, discovered backends are verified, and trusted.
    auth_secret_file: str | None = None
    auth_secret_env: str | None = None
    # Credentials for --discover's metadata store (``metadata.MetadataAuth``).
    discover_user: str | None = None
    discover_password_file: str | None = None
    discover_password_env: str | None = None
    discover_token_file: str | None = None
    discover_token_env: str | None = None
    discover_ca_file: str | None = None
    discover_cert_file: str | None = None
    discover_key_file: str | None = None
    timeout_s: float = Field(300.0, gt=0)
    prefill_timeout_s: float = Field(120.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    health_interval_s: float = Field(5.0, gt=0)
    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0)
    # The whole request body must have arrived this long after its head (408 otherwise): a
    # client that sends a head and then stalls frees its connection and --client-* slot.
    body_timeout_s: float = Field(60.0, gt=0)
    # Prompts in one /v1/completions list (400 beyond): each is a prefill leg and a decode
    # request of its own (``fanout``).
    max_prompts: int = Field(256, ge=1)
    # Legs of one prompt list being sent at once: each holds its own encoded body, which
    # repeats every field of the client's body but the prompt.
    prompt_list_concurrency: int = Field(8, ge=1)
    # OTLP/HTTP traces endpoint (``http://HOST:4318/v1/traces``): a span per request and per
    # leg, the legs' ``traceparent`` their children's parent (``core.tracing``). None: off.
    otlp_traces_endpoint: str | None = None
    log_level: LogLevel = "info"

    @field_validator("server")
    @classmethod
    def _server(cls, server: HttpServer) -> HttpServer:
        return check_installed(server)

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

    @field_validator("kv_events")
    @classmethod
    def _kv_events(cls, pairs: list[str]) -> list[str]:
        out = []
        for pair in pairs:
            url, sep, endpoint = pair.partition("=")
            if not sep:
                raise ValueError(
                    f"{pair!r}: expected BACKEND_URL=tcp://HOST:PORT (the backend's URL as given "
                    "to --prefill/--decode, then its vLLM's kv-events-config endpoint)"
                )
            url = normalize_backend_url(url)  # ValueError names the URL's accepted forms
            if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
                out.append(f"{url}={endpoint}")  # a socket file on this host
                continue
            parts = urlsplit(endpoint.strip())
            try:
                port = parts.port
            except ValueError:
                port = None
            if parts.scheme != "tcp" or not parts.hostname or port is None or "*" in endpoint:
                raise ValueError(
                    f"{pair!r}: the endpoint must be tcp://HOST:PORT, a host the engine's "
                    "publisher listens on (its kv-events-config has tcp://*:PORT), or ipc://PATH"
                )
            out.append(f"{url}={endpoint.strip()}")
        urls = [p.partition("=")[0] for p in out]
        duplicates = sorted({u for u in urls if urls.count(u) > 1})
        if duplicates:
            raise ValueError(f"more than one endpoint for {', '.join(duplicates)}")
        return out

    def kv_event_endpoints(self) -> dict[str, str]:
        """Backend URL -> the ZMQ endpoint its KV events come from."""
        return dict(p.partition("=")[::2] for p in self.kv_events)

    @model_validator(mode="after")
    def _check_kv_events(self) -> ProxyConfig:
        if self.policy is Policy.KV and not self.kv_events:
            raise ValueError(
                "--policy kv needs --kv-events BACKEND_URL=tcp://HOST:PORT for the engines whose "
                "caches it follows (start them with --kv-events-config); without events use "
                "--policy prefix"
            )
        if self.kv_events and self.policy is not Policy.KV:
            raise ValueError("--kv-events is read by --policy kv only: add --policy kv")
        if self.discover is None:
            known = set(self.prefill) | set(self.decode)
            unknown = [u for u in self.kv_event_endpoints() if u not in known]
            if unknown:
                raise ValueError(
                    f"--kv-events names {', '.join(unknown)}, which is not a --prefill or "
                    "--decode backend"
                )
        return self

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, key: str | None) -> str | None:
        if key is not None and not key.strip():
            raise ValueError("must not be empty")
        return key

    @model_validator(mode="after")
    def _check_api_key(self) -> ProxyConfig:
        keys = self.api_keys()  # ValueError names the flag and the fix
        protected = [f for f in ("protect_metrics", "protect_health") if getattr(self, f)]
        if protected and not keys:
            flags = " and ".join(_flag(f) for f in protected)
            raise ValueError(
                f"{flags} needs the API key clients send: give --api-key-file or --api-key-env"
            )
        return self

    def api_keys(self) -> tuple[str, ...]:
        """The keys clients may send (``()``: none asked for)."""
        return load_api_keys(self.api_key, self.api_key_file, self.api_key_env)

    @model_validator(mode="after")
    def _check_dispatch(self) -> ProxyConfig:
        if self.dispatch == "concurrent" and self.mode == "pool":
            raise ValueError(
                "--dispatch concurrent needs --mode p2p: in pool mode the decode finds the "
                "prompt in the pool only after the prefill has put it there"
            )
        return self

    @model_validator(mode="after")
    def _check_limits(self) -> ProxyConfig:
        if self.client_burst is not None and self.client_rate is None:
            raise ValueError("--client-burst needs --client-rate (requests/s per client)")
        return self

    @model_validator(mode="after")
    def _check_secret(self) -> ProxyConfig:
        self.auth_keys()
        return self

    def auth_keys(self) -> auth.Keys:
        """The shared secret's keys (``()``: registry records are not verified)."""
        try:
            return auth.load_keys(self.auth_secret_file, self.auth_secret_env)
        except ValueError as e:  # worded for the connector's config keys: name our flags
            message = str(e)
            for key in ("auth_secret_file", "auth_secret_env"):
                message = message.replace(f"{key}=", f"{_flag(key)} ").replace(key, _flag(key))
            raise ValueError(message) from e

    @model_validator(mode="after")
    def _check_metadata_auth(self) -> ProxyConfig:
        given = _discover_auth_fields(self)
        if given and self.discover is None:
            flags = ", ".join(_flag("discover_" + k) for k in given)
            raise ValueError(f"{flags}: credentials for --discover's store, but no --discover")
        store_auth = self.metadata_auth()
        if self.discover is not None:
            try:  # what the store would ignore, or TLS files for a plain connection
                check_auth(parse_metadata_server(self.discover), store_auth)
            except ValueError as e:
                raise ValueError(_discover_flags_in(str(e))) from e
        return self

    def metadata_auth(self) -> MetadataAuth:
        """Credentials for ``--discover``'s store, from the ``--discover-*`` flags."""
        try:
            return MetadataAuth(**_discover_auth_fields(self))
        except ValidationError as e:  # worded for the connector's metadata_auth: name our flags
            problems = []
            for err in e.errors():
                message = _discover_flags_in(err["msg"].removeprefix("Value error, "))
                where = [_flag(f"discover_{loc}") for loc in err["loc"] if isinstance(loc, str)]
                if where:
                    message = f"{', '.join(where)}: {message} (got {err['input']!r})"
                problems.append(message)
            raise ValueError("; ".join(problems)) from e


_METADATA_AUTH_FIELDS = ("user", "password_file", "password_env", "token_file", "token_env",
                         "ca_file", "cert_file", "key_file")  # fmt: skip
# A key in MetadataAuth's messages: ``password_file``, ``metadata_auth.token_env=``, ``user=``,
# ``metadata_auth.user`` (a bare "user" is a word of the prose).
_METADATA_AUTH_KEY = re.compile(
    r"\b(?:metadata_auth\.)?(?:" + "|".join(_METADATA_AUTH_FIELDS[1:]) + r")\b=?"
    r"|\bmetadata_auth\.user\b=?|\buser="
)


def _discover_flags_in(message: str) -> str:
    """A message about ``metadata_auth``/``metadata_server`` with our flags in their place
    (``password_file`` is ``--discover-password-file``, ``metadata_server`` ``--discover``)."""

    def as_flag(m: re.Match[str]) -> str:
        key = m[0].removeprefix("metadata_auth.").removesuffix("=")
        return _flag("discover_" + key) + (" " if m[0].endswith("=") else "")

    message = _METADATA_AUTH_KEY.sub(as_flag, message.removeprefix("metadata_auth: "))
    return message.replace("metadata_server", "--discover").replace("metadata_auth", "--discover-*")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _discover_auth_fields(cfg: ProxyConfig) -> dict[str, Any]:
    """``MetadataAuth``'s fields given as ``--discover-*`` flags, named as ``MetadataAuth`` names
    them (``discover_user`` is ``user``)."""
    given = {f: getattr(cfg, f"discover_{f}") for f in _METADATA_AUTH_FIELDS}
    return {f: v for f, v in given.items() if v is not None}


def load_api_keys(
    key: str | None,
    key_file: str | None,
    key_env: str | None,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """The clients' API keys from the one place given; ``()`` when none is. A file or variable
    may hold several keys, one per line (any is accepted: rotate by adding the new one first).
    Raises ValueError naming the flag and the fix."""
    environ = os.environ if environ is None else environ
    given = [f for f, v in (("--api-key", key), ("--api-key-file", key_file),
                            ("--api-key-env", key_env)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise ValueError(
            f"give only one of {' and '.join(given)} (--api-key-file or --api-key-env keep the "
            "key out of the process arguments)"
        )
    if key is not None:
        return (key.strip(),)
    found = auth.read_key_lines(
        key_file,
        key_env,
        environ,
        path_setting=f"--api-key-file {key_file!r}",
        variable_setting=f"--api-key-env {key_env!r}",
        file_holds="the key clients send (one per line)",
        export_in="the proxy's environment (the name goes on the command line, not the key)",
        when_empty="holds no key (one per line)",
    )
    return () if found is None else found[0]
