"""What every store shares: the ``Store`` protocol, its errors, and the hints a TLS failure gets."""

from __future__ import annotations

import base64
import ssl
from typing import Protocol

import aiohttp


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


TIMEOUT = aiohttp.ClientTimeout(total=3.0)


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


_HUNG_UP = ("Server disconnected", "Connection reset", "Connection closed")


def connection_hint(
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


def tls_failure(error: BaseException) -> bool:
    """A refused TLS handshake: the same CA and certificate fail on every endpoint and retry."""
    return isinstance(error, (ssl.SSLError, aiohttp.ClientSSLError)) or bool(connection_hint(error))
