"""Credentials for the metadata store: secrets read from files or variables, ``MetadataAuth``
(``metadata_auth`` in the config) and ``check_auth``, that they fit the store named."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from mooncake_vllm.metadata.redaction import url_has_credentials
from mooncake_vllm.metadata.targets import MetadataTarget


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
