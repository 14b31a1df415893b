"""The pool connector's answers to vLLM's hooks that take no engine (no master, no servers)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from mooncake_vllm.pool.connector import MooncakeStoreConnector


def config(kv_role):
    """The one field of vLLM's ``KVTransferConfig`` the base class's default reads."""
    return SimpleNamespace(is_kv_producer=kv_role != "kv_consumer")


def bare(kv_role):
    """A pool connector unbuilt (no settings, no master), with only that config."""
    connector = object.__new__(MooncakeStoreConnector)
    connector._kv_transfer_config = config(kv_role)
    return connector


def test_the_pool_as_kv_both_asks_vllm_for_no_reliable_delivery():
    """Under the default (True for kv_both) vLLM drops a preempted request's in-flight output
    and recomputes it, as for a handoff that must not leave freed blocks; a best-effort cache
    needs none of that."""
    default = KVConnectorBase_V1.requires_kv_delivery.fget
    assert default(SimpleNamespace(_kv_transfer_config=config("kv_both"))) is True
    for role in ("kv_both", "kv_producer", "kv_consumer"):
        assert bare(role).requires_kv_delivery is False
