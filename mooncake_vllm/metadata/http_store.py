"""An http metadata server speaking the transfer engine's protocol."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp

from mooncake_vllm.metadata.auth import MetadataAuth
from mooncake_vllm.metadata.base import (
    TIMEOUT,
    StoreAuthError,
    StoreUnavailable,
    connection_hint,
    tls_failure,
)
from mooncake_vllm.metadata.redaction import redact_url


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
            self._session = aiohttp.ClientSession(timeout=TIMEOUT)
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
            cls = StoreAuthError if tls_failure(e) else StoreUnavailable
            raise cls(f"http {self._shown}: {type(e).__name__}: {e}{connection_hint(e)}") from e
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
