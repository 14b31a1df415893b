"""redis (redis-py, imported when used)."""

from __future__ import annotations

from mooncake_vllm.metadata.auth import MetadataAuth
from mooncake_vllm.metadata.base import StoreAuthError, StoreUnavailable, connection_hint
from mooncake_vllm.metadata.redaction import redact_url, url_has_credentials


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
            hint = connection_hint(e, None if tls else "rediss://", tls and not self._cert)
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
