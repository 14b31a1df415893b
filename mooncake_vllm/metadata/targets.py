"""Where the metadata store is: ``metadata_server`` parsed into a ``MetadataTarget``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from mooncake_vllm.metadata.redaction import redact_url

P2P_HANDSHAKE = "P2PHANDSHAKE"


StoreKind = Literal["p2p", "etcd", "redis", "http"]


ACCEPTED_FORMS = (
    "'P2PHANDSHAKE', 'etcd://host:port' (several: 'etcd://h1:p1,h2:p2'; 'etcds://' over TLS), "
    "'redis://host:port' ('rediss://' over TLS), 'http://host:port/metadata' ('https://' over "
    "TLS), or a bare 'host:port' with metadata_backend 'etcd'|'redis'|'http'"
)


# A scheme ending in "s" is the same store over TLS.
_TLS_SCHEMES = {"etcds": "etcd", "rediss": "redis", "https": "http"}


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
