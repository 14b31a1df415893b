"""The store a ``MetadataTarget`` names (``open_store``)."""

from __future__ import annotations

import logging

from mooncake_vllm.metadata.auth import MetadataAuth, check_auth
from mooncake_vllm.metadata.base import Store
from mooncake_vllm.metadata.etcd_store import EtcdStore
from mooncake_vllm.metadata.http_store import HttpStore
from mooncake_vllm.metadata.redaction import url_has_credentials
from mooncake_vllm.metadata.redis_store import RedisStore
from mooncake_vllm.metadata.targets import MetadataTarget

logger = logging.getLogger(__name__)


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
