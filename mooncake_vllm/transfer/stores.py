"""Where the transfer engine's segment metadata lives: parsing ``metadata_server`` and the stores.

The engine itself only ever sees ``P2PHANDSHAKE`` or an ``http://127.0.0.1:<port>/metadata`` URL
served by this process's ``MetadataBridge`` (``store_bridge``), which stores the keys in the
configured etcd, redis or http server. Why one path for every store:
- the PyPI wheels have no redis client, and reaching it aborts the process;
- a peer restarted under the same name must overwrite its old keys (Mooncake's own http server
  refuses that, and the engine hangs in ``initialize`` on stale etcd keys);
- a store outage must not break peers that already know each other (the bridge serves its cache);
- keys carry a TTL refreshed by a heartbeat, so a crashed engine's keys go away by themselves and
  a store that lost its data (restart) gets them back.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol
from urllib.parse import urlsplit

import aiohttp
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
StoreKind = Literal["p2p", "etcd", "redis", "http"]

ACCEPTED_FORMS = (
    "'P2PHANDSHAKE', 'etcd://host:port' (several: 'etcd://h1:p1,h2:p2'; 'etcds://' over TLS), "
    "'redis://host:port' ('rediss://' over TLS), 'http://host:port/metadata' ('https://' over "
    "TLS), or a bare 'host:port' with metadata_backend 'etcd'|'redis'|'http'"
)
# A scheme ending in "s" is the same store over TLS.
_TLS_SCHEMES = {"etcds": "etcd", "rediss": "redis", "https": "http"}


# ---- credentials --------------------------------------------------------------------------------


def _secret_from_file(path: str) -> str:
    try:
        # A file's trailing line break is not part of the secret (``echo pw > file``).
        secret = Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ValueError(
            f"cannot be read ({why}); point it to a readable file that holds the secret"
        ) from None
    if not secret:
        raise ValueError("the file is empty; write the secret into it")
    return secret


def _secret_from_env(name: str) -> str:
    secret = os.environ.get(name)
    if secret is None:
        raise ValueError(
            "the environment variable is not set; export it in the server's environment "
            "(never on a command line)"
        )
    if not secret:
        raise ValueError("the environment variable is empty")
    return secret


def read_secret(file: str | None, env: str | None, file_key: str, env_key: str) -> str | None:
    """The secret in ``file`` or in the environment variable ``env``; None when neither is set.
    ValueError names the setting (``file_key``/``env_key``, e.g. ``metadata_auth.password_file``
    or ``--token-file``) and the fix, never the secret."""
    if file and env:
        raise ValueError(f"set {file_key} or {env_key}, not both")
    try:
        if file:
            return _secret_from_file(file)
        if env:
            return _secret_from_env(env)
    except ValueError as e:
        key, value = (file_key, file) if file else (env_key, env)
        raise ValueError(f"{key}={value!r}: {e}") from None
    return None


class MetadataAuth(BaseModel):
    """Credentials for the metadata store (``metadata_auth`` in the config). Secrets come from
    files or environment variables named here, never from the config or a command line; they
    are read when used (an etcd login, a new redis connection, each http request), so a
    rotated file is picked up without a restart.

    - etcd: ``user`` and ``password_file``|``password_env`` (etcd's own users, v3 auth); the
      JSON gateway's token is kept and renewed when etcd refuses it.
    - redis: ``password_file``|``password_env``, with ``user`` for an ACL user (else ``default``).
    - http: ``token_file``|``token_env``, sent as ``Authorization: Bearer <token>``.
    - TLS (``etcds://``, ``rediss://``, ``https://``): ``ca_file`` verifies the server (default:
      the system's CAs); ``cert_file`` (+ ``key_file`` unless the key is in it) is the client's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    user: str | None = None
    password_file: str | None = None
    password_env: str | None = None
    token_file: str | None = None
    token_env: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @field_validator("password_file", "token_file")
    @classmethod
    def _secret_file(cls, v: str | None) -> str | None:
        if v is not None:  # the validation error's location names the key
            _secret_from_file(v)
        return v

    @field_validator("password_env", "token_env")
    @classmethod
    def _secret_env(cls, v: str | None) -> str | None:
        if v is not None:
            _secret_from_env(v)
        return v

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _readable(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                Path(v).read_bytes()
            except OSError as e:
                raise ValueError(
                    f"cannot be read ({e.strerror}); point it to a readable PEM file"
                ) from e
        return v

    @model_validator(mode="after")
    def _check_pairs(self) -> MetadataAuth:
        for what in ("password", "token"):
            if getattr(self, f"{what}_file") and getattr(self, f"{what}_env"):
                raise ValueError(
                    f"metadata_auth: set {what}_file or {what}_env, not both (one place for "
                    f"the {what})"
                )
        if self.user is not None and not (self.password_file or self.password_env):
            raise ValueError(
                f"metadata_auth: user={self.user!r} has no password; set password_file or "
                "password_env"
            )
        if self.key_file and not self.cert_file:
            raise ValueError(
                "metadata_auth: key_file without cert_file; set cert_file to the client "
                "certificate the key belongs to"
            )
        if self.uses_tls_files:
            self.ssl_context()  # a bad PEM or a key that does not match fails here, at startup
        return self

    @property
    def uses_tls_files(self) -> bool:
        return any((self.ca_file, self.cert_file, self.key_file))

    def password(self) -> str | None:
        """The password (read now); None when none is configured. ValueError names the key."""
        return read_secret(
            self.password_file,
            self.password_env,
            "metadata_auth.password_file",
            "metadata_auth.password_env",
        )

    def token(self) -> str | None:
        """The http bearer token (read now); None when none is configured."""
        return read_secret(
            self.token_file, self.token_env, "metadata_auth.token_file", "metadata_auth.token_env"
        )

    def ssl_context(self) -> ssl.SSLContext:
        """A client context verifying the server against ``ca_file`` (or the system's CAs),
        presenting ``cert_file`` when set. ValueError names the key of a file that does not load."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(
                f"metadata_auth.ca_file={self.ca_file!r} is not a PEM CA certificate ({e})"
            ) from e
        if self.cert_file:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as e:
                key = "in the same file" if self.key_file is None else f"{self.key_file!r}"
                raise ValueError(
                    f"metadata_auth.cert_file={self.cert_file!r} does not load with its private "
                    f"key {key} ({e}); point cert_file to the client certificate (PEM) and "
                    "key_file to its key"
                ) from e
        return context


# ---- where the store is -------------------------------------------------------------------------


# A query parameter whose value is a credential: its name is one of these words, alone or as the
# last part of a longer name (access_token, api_key, client_secret, X-Amz-Signature, x-api-key).
_SECRET_QUERY = re.compile(
    r"(?i)(?:(?<=[?&;])|^)((?:[a-z0-9]*[_.-])*"
    r"(?:password|passwd|pass|pwd|token|secret|key|apikey|auth|authorization|credentials?"
    r"|sig|signature))=[^&#;]*"
)


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` (or ``user@``) and secret-looking query values
    replaced by ``***``: the only form of a store URL that may be logged or shown."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/") if sep else url.partition("/")
    _, at, host = netloc.rpartition("@")
    if at:
        netloc = f"***@{host}"
    redacted = f"{scheme}{sep}{netloc}{slash}{tail}" if sep else f"{netloc}{slash}{tail}"
    return _SECRET_QUERY.sub(lambda m: f"{m.group(1)}=***", redacted)


def url_has_credentials(url: str) -> bool:
    return redact_url(url) != url


@dataclass(frozen=True)
class MetadataTarget:
    """A parsed ``metadata_server``: the kind of store and how to reach it."""

    kind: StoreKind
    # etcd: host:port endpoints; redis: one redis:// or rediss:// URL; http: one URL; p2p: none.
    endpoints: tuple[str, ...] = ()
    # Over TLS: etcds://, rediss://, https:// (redis and http URLs also say it by their scheme).
    tls: bool = False

    def describe(self) -> str:
        """How logs and errors name the store: credentials in a URL are shown as ``***``."""
        if self.kind == "p2p":
            return P2P_HANDSHAKE
        shown = ",".join(redact_url(e) for e in self.endpoints)
        return f"{self.kind} {shown}" + (" (TLS)" if self.kind == "etcd" and self.tls else "")


def split_host_port(value: str) -> tuple[str, int] | None:
    """``"host:port"`` → ``(host, port)``; None when it is not that (callers word the error)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _check_host_port(value: str, shown: str) -> str:
    if split_host_port(value.strip()) is None:
        raise ValueError(f"metadata_server={shown!r}: {redact_url(value)!r} is not 'host:port'")
    return value.strip()


def parse_metadata_server(server: str, backend: str | None = None) -> MetadataTarget:
    """``metadata_server`` (+ legacy ``metadata_backend``) → target; ValueError names the forms.

    TLS is chosen by the scheme: ``etcds://``, ``rediss://``, ``https://`` (``metadata_auth``
    says which CA and client certificate). Errors show the URL with its credentials redacted."""
    if server == P2P_HANDSHAKE:
        return MetadataTarget("p2p")
    shown = redact_url(server)
    scheme, sep, rest = server.partition("://")
    if not sep:  # legacy bare form: host:port[,host:port], interpreted with metadata_backend
        if backend is None and ":" not in server:
            raise ValueError(f"metadata_server={shown!r}: accepted forms are {ACCEPTED_FORMS}")
        scheme, rest = backend or "etcd", server
        if scheme == "http":
            rest = f"{rest}/metadata"
    elif backend is not None and backend != _TLS_SCHEMES.get(scheme, scheme):
        raise ValueError(
            f"metadata_backend={backend!r} contradicts metadata_server={shown!r}; drop "
            "metadata_backend (the URL scheme says it) or make them agree"
        )
    tls = scheme in _TLS_SCHEMES
    kind = _TLS_SCHEMES.get(scheme, scheme)
    if kind == "etcd":
        parts = [p for p in rest.replace(";", ",").split(",") if p.strip()]
        if not parts:
            raise ValueError(f"metadata_server={shown!r}: no etcd endpoint given")
        if "@" in rest:
            raise ValueError(
                f"metadata_server={shown!r}: credentials do not go in an etcd URL; set "
                "metadata_auth.user and metadata_auth.password_file or password_env"
            )
        return MetadataTarget("etcd", tuple(_check_host_port(p, shown) for p in parts), tls)
    if kind == "redis":
        _check_host_port(rest.split("/", 1)[0].rpartition("@")[2], shown)
        return MetadataTarget("redis", (f"{scheme}://{rest}",), tls)
    if kind == "http":
        url = f"{scheme}://{rest}"
        if not urlsplit(url).hostname:
            raise ValueError(f"metadata_server={shown!r}: no host in the URL")
        return MetadataTarget("http", (url,), tls)
    raise ValueError(f"metadata_server={shown!r}: accepted forms are {ACCEPTED_FORMS}")


def check_auth(target: MetadataTarget, auth: MetadataAuth) -> None:
    """That ``auth`` fits the store ``target`` names; ValueError names the keys and the fix.

    Called by ``open_store`` (and the bridge before it starts), so a credential the store would
    ignore, or TLS files for a plain connection, stop the server at startup instead of being
    silently unused."""
    given = [k for k, v in auth.model_dump().items() if v is not None]
    if target.kind == "p2p":
        if given:
            raise ValueError(
                f"metadata_auth sets {', '.join(given)} but metadata_server is P2PHANDSHAKE (no "
                "store): drop metadata_auth or configure a store"
            )
        return
    where = f"metadata_server ({target.describe()})"
    plain = {"etcd": "etcd://", "redis": "redis://", "http": "http://"}[target.kind]
    if auth.uses_tls_files and not target.tls:
        tls_form = {"etcd": "etcds://", "redis": "rediss://", "http": "https://"}[target.kind]
        raise ValueError(
            f"metadata_auth.ca_file/cert_file/key_file are TLS settings but {where} is a plain "
            f"{plain} connection; use '{tls_form}...' or drop them"
        )
    if target.kind in ("etcd", "redis") and (auth.token_file or auth.token_env):
        raise ValueError(
            f"metadata_auth.token_file/token_env are for the http metadata server; {where} "
            "takes metadata_auth.user and password_file or password_env"
        )
    if target.kind == "etcd" and auth.user is None and (auth.password_file or auth.password_env):
        raise ValueError(
            f"{where}: an etcd password belongs to a user; set metadata_auth.user (e.g. 'root')"
        )
    sets_login = auth.user is not None or auth.password_file or auth.password_env
    if target.kind == "redis" and sets_login and url_has_credentials(target.endpoints[0]):
        raise ValueError(
            f"{where} carries credentials in its URL and metadata_auth sets user/password "
            "too; drop them from the URL (keep metadata_auth.password_file or password_env)"
        )
    if target.kind == "http" and sets_login:
        raise ValueError(
            f"{where}: the http metadata server takes a bearer token, not a user or password; "
            "set metadata_auth.token_file or token_env instead"
        )


# ---- stores -------------------------------------------------------------------------------------


class StoreUnavailable(RuntimeError):
    """The store could not be reached or answered with an error."""


class StoreAuthError(StoreUnavailable):
    """The store refused our credentials, asked for some, or refused the TLS handshake over
    them. The message names the ``metadata_auth`` key to fix, never a secret."""


class Store(Protocol):
    """An async key-value store; every method raises ``StoreUnavailable`` on failure."""

    async def ping(self) -> None: ...
    async def get(self, key: str) -> bytes | None: ...
    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None: ...
    async def delete(self, key: str) -> None: ...
    async def list(self, prefix: str) -> dict[str, bytes]: ...
    async def close(self) -> None: ...


_TIMEOUT = aiohttp.ClientTimeout(total=3.0)


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


_HUNG_UP = ("Server disconnected", "Connection reset", "Connection closed")


def _connection_hint(
    error: BaseException, tls_scheme: str | None = None, no_client_cert: bool = False
) -> str:
    """What to fix for a TLS failure (appended to the error), or "". ``tls_scheme``: the
    target is plain, and this is its TLS form (a TLS server hangs up on a plain client).
    ``no_client_cert``: a TLS target and no client certificate configured; under TLS 1.3 a
    server that requires one may hang up after the handshake instead of sending its alert."""
    if tls_scheme and any(s in str(error) for s in _HUNG_UP):
        return f"; if the server speaks TLS on this port, use '{tls_scheme}'"
    if no_client_cert and any(s in str(error) for s in _HUNG_UP):
        return (
            "; the server hung up after the TLS handshake: if it wants a client certificate "
            "signed by its CA, set metadata_auth.cert_file and key_file"
        )
    text = str(error).upper()
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            "; the server's certificate did not verify: set metadata_auth.ca_file to the CA "
            "that signed it (and check the host name is in the certificate)"
        )
    if any(alert in text for alert in ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA")):
        return (
            "; the server wants a client certificate signed by its CA: set "
            "metadata_auth.cert_file and key_file"
        )
    if "WRONG_VERSION_NUMBER" in text or "RECORD_LAYER_FAILURE" in text:
        return "; the server does not speak TLS on this port: use the plain scheme or its TLS port"
    return ""


def _tls_failure(error: BaseException) -> bool:
    """A refused TLS handshake: the same CA and certificate fail on every endpoint and retry."""
    return isinstance(error, (ssl.SSLError, aiohttp.ClientSSLError)) or bool(
        _connection_hint(error)
    )


class _TokenRefused(StoreAuthError):
    """etcd refused the auth token (expired, or etcd restarted): log in again."""


class EtcdStore:
    """etcd v3 through its JSON gateway (no client library); tries each endpoint in turn.

    A key with a TTL is attached to a lease granted for that TTL; the caller's heartbeat puts
    it again before the lease ends (each put gets a fresh lease, the old one lapses).

    With ``metadata_auth.user`` every call carries the token of ``/v3/auth/authenticate`` in
    the ``Authorization`` header; etcd's tokens expire (``--auth-token-ttl``, 5 min idle by
    default) and die with a restart, so a refused token (401) is replaced by one new login and
    the call repeated once. Over TLS (``etcds://``) the gateway is reached by https."""

    def __init__(
        self, endpoints: tuple[str, ...], auth: MetadataAuth | None = None, tls: bool = False
    ):
        self._endpoints = list(endpoints)
        self._auth = auth or MetadataAuth()
        self._scheme = "https" if tls else "http"
        self._ssl: ssl.SSLContext | bool = self._auth.ssl_context() if tls else False
        self._tls_form = None if tls else "etcds://"  # the hint when a TLS server hangs up
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = None
        self._login: asyncio.Lock | None = None  # one login at a time; created on the loop

    async def _post(self, path: str, body: dict, token: str | None = None) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT)
        headers = {"Authorization": token} if token else None
        errors = []
        for i, endpoint in enumerate(list(self._endpoints)):
            url = f"{self._scheme}://{endpoint}{path}"
            try:
                async with self._session.post(
                    url, json=body, headers=headers, ssl=self._ssl
                ) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise self._refusal(endpoint, path, resp.status, text)
                    if i:  # remember the endpoint that answered
                        self._endpoints.insert(0, self._endpoints.pop(i))
                    return json.loads(text)
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
                if _tls_failure(e):  # the same CA and certificate everywhere: no use going on
                    raise StoreAuthError(
                        f"etcd {endpoint}: TLS handshake failed: {e}{_connection_hint(e)}"
                    ) from e
                hint = _connection_hint(e, self._tls_form)
                errors.append(f"{endpoint}: {type(e).__name__}: {e}{hint}")
        raise StoreUnavailable("etcd unreachable (" + "; ".join(errors) + ")")

    def _refusal(self, endpoint: str, path: str, status: int, text: str) -> StoreUnavailable:
        """etcd's error answer → the exception that says what to fix."""
        try:
            message = str(json.loads(text).get("error") or text)
        except (json.JSONDecodeError, AttributeError):
            message = text.strip()
        where, user = f"etcd {endpoint}", self._auth.user
        if status == 401:
            return _TokenRefused(f"{where}{path}: the auth token was refused ({message})")
        if "user name is empty" in message:
            return StoreAuthError(
                f"{where}: etcd has authentication on and no user was given; set "
                "metadata_auth.user and metadata_auth.password_file or password_env"
            )
        if "authentication failed" in message:
            return StoreAuthError(
                f"{where}: logging in as user {user!r} failed ({message}); check "
                "metadata_auth.user and the password in metadata_auth.password_file/password_env"
            )
        if "authentication is not enabled" in message:
            return StoreAuthError(
                f"{where}: metadata_auth.user is set but etcd has authentication off; enable it "
                "(etcdctl auth enable) or drop metadata_auth.user and the password"
            )
        if "permission denied" in message:
            return StoreAuthError(
                f"{where}{path}: user {user!r} is not permitted ({message}); grant its role "
                "readwrite on the key prefixes 'mooncake/' and 'mooncake-vllm/'"
            )
        if "CommonName" in message:
            return StoreAuthError(
                f"{where}: {message}: etcd's JSON gateway refuses a client certificate with a "
                "common name while authentication is on; use one without (subject alternative "
                "names only) or drop metadata_auth.cert_file"
            )
        return StoreUnavailable(f"{where}{path}: HTTP {status} {message[:200]}")

    async def _authenticate(self) -> str:
        if self._login is None:
            self._login = asyncio.Lock()
        stale = self._token
        async with self._login:
            if self._token is not None and self._token != stale:
                return self._token  # another call logged in while this one waited
            try:
                password = self._auth.password()
            except ValueError as e:
                raise StoreAuthError(f"etcd: {e}") from None
            body = {"name": self._auth.user, "password": password}
            self._token = (await self._post("/v3/auth/authenticate", body))["token"]
            return self._token

    async def _call(self, path: str, body: dict) -> dict:
        if self._auth.user is None:
            return await self._post(path, body)
        token = self._token or await self._authenticate()
        try:
            return await self._post(path, body, token)
        except _TokenRefused:
            self._token = None if self._token == token else self._token
            return await self._post(path, body, await self._authenticate())

    async def ping(self) -> None:
        # A read, not /v3/maintenance/status: etcd answers status without authentication, so
        # only a read shows at startup that the credentials (or their absence) do not work.
        await self._call("/v3/kv/range", {"key": _b64("mooncake-vllm/ping"), "count_only": True})

    async def get(self, key: str) -> bytes | None:
        kvs = (await self._call("/v3/kv/range", {"key": _b64(key)})).get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if ttl_s is not None:
            lease = await self._call("/v3/lease/grant", {"TTL": max(1, round(ttl_s))})
            body["lease"] = lease["ID"]
        await self._call("/v3/kv/put", body)

    async def delete(self, key: str) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    async def list(self, prefix: str) -> dict[str, bytes]:
        raw = prefix.encode()
        range_end = raw[:-1] + bytes([raw[-1] + 1])  # every key that starts with prefix
        body = {"key": _b64(raw), "range_end": _b64(range_end)}
        kvs = (await self._call("/v3/kv/range", body)).get("kvs") or []
        return {
            base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
            for kv in kvs
        }

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class _RedisCredentials:
    """redis-py's ``CredentialProvider`` (duck-typed: redis is imported only when used): the
    password is read for each new connection, so a rotated file is picked up."""

    def __init__(self, auth: MetadataAuth):
        self._auth = auth

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        password = self._auth.password()
        assert password is not None  # open_store only passes this with a password
        return (password,) if self._auth.user is None else (self._auth.user, password)

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        return self.get_credentials()


class RedisStore:
    """redis (``redis://``) or redis over TLS (``rediss://``, with ``metadata_auth``'s CA and
    client certificate); ``AUTH`` with ``metadata_auth``'s password (and ACL user)."""

    def __init__(self, url: str, auth: MetadataAuth | None = None):
        import redis.asyncio as aioredis

        auth = auth or MetadataAuth()
        self._cert = bool(auth.cert_file)
        self._url = redact_url(url)  # what errors show
        options: dict = {"socket_timeout": 3, "socket_connect_timeout": 3}
        self._logs_in = bool(auth.password_file or auth.password_env or url_has_credentials(url))
        if auth.password_file or auth.password_env:
            options["credential_provider"] = _RedisCredentials(auth)
        if url.startswith("rediss://"):
            options |= {
                "ssl_ca_certs": auth.ca_file,
                "ssl_certfile": auth.cert_file,
                "ssl_keyfile": auth.key_file,
            }
        self._redis = aioredis.Redis.from_url(url, **options)

    async def _do(self, what: str, coro):
        import redis.exceptions

        try:
            return await coro
        except redis.exceptions.AuthenticationError as e:
            if not self._logs_in:
                raise StoreAuthError(
                    f"redis {self._url} {what}: the server wants a password and none is "
                    "configured; set metadata_auth.password_file or password_env (and "
                    "metadata_auth.user for an ACL user)"
                ) from e
            raise StoreAuthError(
                f"redis {self._url} {what}: the server refused our user or password ({e}); "
                "check metadata_auth.password_file/password_env (and metadata_auth.user for an "
                "ACL user)"
            ) from e
        except redis.exceptions.NoPermissionError as e:
            raise StoreAuthError(
                f"redis {self._url} {what}: the ACL user may not do this ({e}); grant it the "
                "keys '~mooncake*' and the commands GET SET DEL SCAN MGET PING"
            ) from e
        except ValueError as e:  # a password file or variable that went away since startup
            raise StoreAuthError(f"redis {self._url} {what}: {e}") from e
        except (redis.exceptions.RedisError, OSError) as e:
            tls = self._url.startswith("rediss://")
            hint = _connection_hint(e, None if tls else "rediss://", tls and not self._cert)
            cls = StoreAuthError if hint and self._url.startswith("rediss://") else StoreUnavailable
            raise cls(f"redis {self._url} {what}: {type(e).__name__}: {e}{hint}") from e

    async def ping(self) -> None:
        await self._do("PING", self._redis.ping())

    async def get(self, key: str) -> bytes | None:
        return await self._do("GET", self._redis.get(key))

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        ex = max(1, round(ttl_s)) if ttl_s is not None else None
        await self._do("SET", self._redis.set(key, value, ex=ex))

    async def delete(self, key: str) -> None:
        await self._do("DEL", self._redis.delete(key))

    async def list(self, prefix: str) -> dict[str, bytes]:
        async def scan() -> dict[str, bytes]:
            pattern = "".join(f"[{c}]" if c in "*?[]\\" else c for c in prefix) + "*"
            keys = [k async for k in self._redis.scan_iter(match=pattern, count=1000)]
            values = await self._redis.mget(keys) if keys else []
            # A key that expired between SCAN and MGET reads as None: it is gone.
            return {k.decode(): v for k, v in zip(keys, values, strict=True) if v is not None}

        return await self._do("SCAN", scan())

    async def close(self) -> None:
        await self._redis.aclose()


class HttpStore:
    """An http metadata server speaking the engine's protocol: GET/PUT/DELETE ``url?key=``.

    ``ttl`` is sent as a query parameter (ours honours it; Mooncake's ignores it). Mooncake's
    server refuses to overwrite some keys, so a refused PUT is retried after a DELETE.
    With ``metadata_auth.token_file``|``token_env`` each request carries
    ``Authorization: Bearer <token>``; over ``https://`` ``metadata_auth``'s CA and client
    certificate apply."""

    def __init__(self, url: str, auth: MetadataAuth | None = None):
        self._url = url
        self._shown = redact_url(url)
        self._auth = auth or MetadataAuth()
        self._ssl = self._auth.ssl_context() if url.startswith("https://") else None
        self._session: aiohttp.ClientSession | None = None

    async def _request(self, method: str, params: dict, data: bytes | None = None):
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT)
        try:
            token = self._auth.token()
        except ValueError as e:
            raise StoreAuthError(f"http {self._shown}: {e}") from None
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            async with self._session.request(
                method, self._url, params=params, data=data, headers=headers, ssl=self._ssl
            ) as r:
                status, body = r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            cls = StoreAuthError if _tls_failure(e) else StoreUnavailable
            raise cls(f"http {self._shown}: {type(e).__name__}: {e}{_connection_hint(e)}") from e
        if status == 401:
            raise StoreAuthError(
                f"http {self._shown}: {method} answered 401: "
                + (
                    "the server refused the bearer token; put its token in "
                    "metadata_auth.token_file or token_env"
                    if token
                    else "the server wants a bearer token; set metadata_auth.token_file or "
                    "token_env"
                )
            )
        return status, body

    async def ping(self) -> None:
        status, body = await self._request("GET", {"key": "mooncake-vllm/ping"})
        if status not in (200, 404):
            raise StoreUnavailable(f"http {self._shown}: GET answered {status} {body[:200]!r}")

    async def get(self, key: str) -> bytes | None:
        status, body = await self._request("GET", {"key": key})
        if status == 404:
            return None
        if status != 200:
            raise StoreUnavailable(f"http {self._shown}: GET {key} answered {status}")
        return body

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        params = {"key": key} if ttl_s is None else {"key": key, "ttl": str(round(ttl_s))}
        status, body = await self._request("PUT", params, value)
        if status != 200:
            await self._request("DELETE", {"key": key})
            status, body = await self._request("PUT", params, value)
        if status != 200:
            raise StoreUnavailable(
                f"http {self._shown}: PUT {key} answered {status} {body[:200]!r}"
            )

    async def delete(self, key: str) -> None:
        status, _ = await self._request("DELETE", {"key": key})
        if status not in (200, 404):
            raise StoreUnavailable(f"http {self._shown}: DELETE {key} answered {status}")

    async def list(self, prefix: str) -> dict[str, bytes]:
        """``GET url?prefix=P`` → ``{key: base64 value}``: our metadata server's extension
        (Mooncake's server does not list keys)."""
        status, body = await self._request("GET", {"prefix": prefix})
        try:
            listed = json.loads(body) if status == 200 else None
        except json.JSONDecodeError:
            listed = None
        if not isinstance(listed, dict):
            raise StoreUnavailable(
                f"http {self._shown}: listing keys by prefix answered {status} {body[:200]!r}; "
                "discovery over http needs mooncake_vllm.transfer.http_store (Mooncake's http "
                "metadata server cannot list keys)"
            )
        return {k: base64.b64decode(v) for k, v in listed.items()}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class MemoryStore:
    """In-process store with TTLs and optional persistence (a JSON snapshot rewritten on change):
    the backing store of ``python -m mooncake_vllm.transfer.http_store``."""

    def __init__(self, persist_path: Path | None = None):
        self._data: dict[str, tuple[bytes, float | None]] = {}  # key -> (value, expiry monotonic)
        self._path = persist_path
        if persist_path is not None and persist_path.exists():
            saved = json.loads(persist_path.read_text())
            # TTLs restart from the snapshot's load: owners re-put within their heartbeat.
            self._data = {
                k: (base64.b64decode(v), None if ttl is None else time.monotonic() + ttl)
                for k, (v, ttl) in saved.items()
            }

    def _live(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] is not None and item[1] < time.monotonic():
            del self._data[key]
            return None
        return item[0]

    def _save(self) -> None:
        if self._path is None:
            return
        now = time.monotonic()
        snapshot = {
            k: (_b64(v), None if exp is None else max(0.0, exp - now))
            for k, (v, exp) in self._data.items()
        }
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snapshot))
        tmp.replace(self._path)

    async def ping(self) -> None:
        return

    async def get(self, key: str) -> bytes | None:
        return self._live(key)

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        self._data[key] = (value, None if ttl_s is None else time.monotonic() + ttl_s)
        self._save()

    async def delete(self, key: str) -> None:
        if self._data.pop(key, None) is not None:
            self._save()

    async def list(self, prefix: str) -> dict[str, bytes]:
        keys = [k for k in self._data if k.startswith(prefix)]
        return {k: v for k in keys if (v := self._live(k)) is not None}

    async def close(self) -> None:
        return


def open_store(target: MetadataTarget, auth: MetadataAuth | None = None) -> Store:
    """The store ``target`` names, with ``auth``'s credentials and TLS files (checked by
    ``check_auth``: ValueError names the key). Connects lazily: ``ping`` to test it."""
    auth = auth or MetadataAuth()
    check_auth(target, auth)
    if any(url_has_credentials(e) for e in target.endpoints):
        logger.warning(
            "metadata_server %s carries credentials in its URL (shown as ***): anyone who can "
            "read the config or this process's arguments sees them; put the password in a file "
            "or variable named by metadata_auth.password_file or password_env instead",
            target.describe(),
        )
    if target.kind == "etcd":
        return EtcdStore(target.endpoints, auth, target.tls)
    if target.kind == "redis":
        return RedisStore(target.endpoints[0], auth)
    if target.kind == "http":
        return HttpStore(target.endpoints[0], auth)
    raise ValueError(f"no store for {target.describe()}")
