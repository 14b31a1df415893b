"""Where the transfer engine's segment metadata lives: ``metadata_server`` parsed, the credentials,
URL redaction and the stores. Below ``transfer`` and ``proxy``; imports nothing of the package.

The engine itself only ever sees ``P2PHANDSHAKE`` or an ``http://127.0.0.1:<port>/metadata`` URL
served by this process's ``MetadataBridge`` (``transfer.store_bridge``), which stores the
keys in the configured etcd, redis or http server. Why one path for every store:
- the PyPI wheels have no redis client, and reaching it aborts the process;
- a peer restarted under the same name must overwrite its old keys (Mooncake's own http server
  refuses that, and the engine hangs in ``initialize`` on stale etcd keys);
- a store outage must not break peers that already know each other (the bridge serves its cache);
- keys carry a TTL refreshed by a heartbeat, so a crashed engine's keys go away by themselves and
  a store that lost its data (restart) gets them back.

Modules: ``targets`` (``parse_metadata_server``), ``redaction`` (``redact_url``), ``auth``
(``MetadataAuth``, ``read_secret``, ``check_auth``), ``base`` (the ``Store`` protocol and its
errors), one module per store (``etcd_store``, ``redis_store``, ``http_store``, ``memory_store``)
and ``factory`` (``open_store``). The names below are the package's API.
"""

from __future__ import annotations

from mooncake_vllm.metadata.auth import MetadataAuth, check_auth, read_secret
from mooncake_vllm.metadata.base import Store, StoreAuthError, StoreUnavailable
from mooncake_vllm.metadata.etcd_store import EtcdStore
from mooncake_vllm.metadata.factory import open_store
from mooncake_vllm.metadata.http_store import HttpStore
from mooncake_vllm.metadata.memory_store import MemoryStore
from mooncake_vllm.metadata.redaction import redact_url, url_has_credentials
from mooncake_vllm.metadata.redis_store import RedisStore
from mooncake_vllm.metadata.targets import (
    ACCEPTED_FORMS,
    P2P_HANDSHAKE,
    MetadataTarget,
    StoreKind,
    parse_metadata_server,
    split_host_port,
)

__all__ = [
    "ACCEPTED_FORMS",
    "P2P_HANDSHAKE",
    "EtcdStore",
    "HttpStore",
    "MemoryStore",
    "MetadataAuth",
    "MetadataTarget",
    "RedisStore",
    "Store",
    "StoreAuthError",
    "StoreKind",
    "StoreUnavailable",
    "check_auth",
    "open_store",
    "parse_metadata_server",
    "read_secret",
    "redact_url",
    "split_host_port",
    "url_has_credentials",
]
