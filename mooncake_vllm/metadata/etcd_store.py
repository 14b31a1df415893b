"""etcd v3 through its JSON gateway."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl

import aiohttp

from mooncake_vllm.metadata.auth import MetadataAuth
from mooncake_vllm.metadata.base import (
    TIMEOUT,
    StoreAuthError,
    StoreUnavailable,
    b64,
    connection_hint,
    tls_failure,
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
            self._session = aiohttp.ClientSession(timeout=TIMEOUT)
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
                if tls_failure(e):  # the same CA and certificate everywhere: no use going on
                    raise StoreAuthError(
                        f"etcd {endpoint}: TLS handshake failed: {e}{connection_hint(e)}"
                    ) from e
                hint = connection_hint(e, self._tls_form)
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
        await self._call("/v3/kv/range", {"key": b64("mooncake-vllm/ping"), "count_only": True})

    async def get(self, key: str) -> bytes | None:
        kvs = (await self._call("/v3/kv/range", {"key": b64(key)})).get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        body = {"key": b64(key), "value": b64(value)}
        if ttl_s is not None:
            lease = await self._call("/v3/lease/grant", {"TTL": max(1, round(ttl_s))})
            body["lease"] = lease["ID"]
        await self._call("/v3/kv/put", body)

    async def delete(self, key: str) -> None:
        await self._call("/v3/kv/deleterange", {"key": b64(key)})

    async def list(self, prefix: str) -> dict[str, bytes]:
        raw = prefix.encode()
        range_end = raw[:-1] + bytes([raw[-1] + 1])  # every key that starts with prefix
        body = {"key": b64(raw), "range_end": b64(range_end)}
        kvs = (await self._call("/v3/kv/range", body)).get("kvs") or []
        return {
            base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
            for kv in kvs
        }

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
