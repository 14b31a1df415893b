"""The pool's worker half in-process against a real mooncake_master: KV tensors shaped like
vLLM's CPU cache are put from and got into directly (registered memory), a put of what the pool
holds is skipped, a missing block fails the load, a full pool and a dead master fail puts
without raising (no vLLM servers; the master starts in about a second)."""

from __future__ import annotations

import time

import pytest
import torch

from harness.servers import start_mooncake_master
from mooncake_vllm.core.kv_groups import KVGroup
from mooncake_vllm.core.settings import load_settings
from mooncake_vllm.pool.config import PoolSettings
from mooncake_vllm.pool.keys import block_keys
from mooncake_vllm.pool.step_metadata import BlockTransfer, PoolConnectorMetadata
from mooncake_vllm.pool.worker import PoolWorkerHalf

pytestmark = pytest.mark.servers

NUM_BLOCKS = 40
SHAPE = (2, NUM_BLOCKS, 128, 2, 64)  # (K/V, blocks, block_size, kv heads, head_dim): 64 KiB
BLOCK_BYTES = 2 * 2 * 128 * 2 * 64 * 4  # two layers × K and V


@pytest.fixture(scope="module")
def master():
    m = start_mooncake_master()
    yield m
    m.stop()


def worker(
    master, tp_rank=0, replicated=False, kv_groups=None, **settings
) -> tuple[PoolWorkerHalf, dict[str, torch.Tensor]]:
    s = load_settings(
        {"master_server_address": master.address, "metadata_server": master.metadata_url,
         "global_segment_size": "16MB", "load_timeout_s": 5, **settings},
        env={}, model=PoolSettings,
    )  # fmt: skip
    w = PoolWorkerHalf(s, is_producer=True, is_consumer=True, tp_rank=tp_rank,
                       num_blocks=NUM_BLOCKS, kv_replicated=replicated,
                       kv_groups=kv_groups or (KVGroup(()),))  # fmt: skip
    caches = {f"model.layers.{i}.attn": torch.zeros(SHAPE) for i in range(2)}
    w.register_kv_caches(caches)
    return w, caches


@pytest.fixture(scope="module")
def pair(master):
    writer, w_caches = worker(master)
    reader, r_caches = worker(master)
    for t in w_caches.values():
        t.copy_(torch.randn(SHAPE))
    yield writer, w_caches, reader, r_caches
    writer.shutdown()
    reader.shutdown()


def save(w: PoolWorkerHalf, digests, block_ids) -> dict:
    w.start_load_kv(PoolConnectorMetadata(saves=[BlockTransfer("save", digests, block_ids)]))
    w.wait_for_save()
    return w.get_stats().data


def load(w: PoolWorkerHalf, req_id, digests, block_ids, timeout_s=10.0):
    w.start_load_kv(PoolConnectorMetadata(loads=[BlockTransfer(req_id, digests, block_ids)]))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = w.get_transfer_results()
        if req_id in r.finished_recving:
            return req_id not in r.failed_recving
        time.sleep(0.01)
    raise AssertionError(f"load {req_id} not reported within {timeout_s}s")


def test_blocks_go_through_the_pool_into_other_blocks_of_another_cache(pair):
    writer, w_caches, reader, r_caches = pair
    stats = save(writer, ["a0", "a1", "a2"], [5, 6, 7])
    assert stats["put_blocks"] == 3 and stats["put_bytes"] == 3 * BLOCK_BYTES
    assert stats["put_failures"] == 0
    assert load(reader, "r1", ["a0", "a1", "a2"], [1, 2, 3])
    for name in w_caches:
        for kv in (0, 1):
            assert torch.equal(r_caches[name][kv, 1:4], w_caches[name][kv, 5:8])
        assert not r_caches[name][:, 0].any() and not r_caches[name][:, 4].any()  # untouched
    assert reader.get_stats().data["get_blocks"] == 3
    # The writer put them into its own segment (a local copy); the reader pulled them from there.
    own = writer._store._store.get_hostname()
    for key in block_keys(["a0", "a1", "a2"], 0):
        (replica,) = writer._store._store.get_replica_desc(key)
        assert replica.get_memory_descriptor().buffer_descriptor.transport_endpoint == own


def test_what_the_pool_holds_is_not_put_again(pair):
    writer = pair[0]
    stats = save(writer, ["b0"], [9])
    assert stats["put_blocks"] == 1
    stats = save(writer, ["b0", "b1"], [9, 10])
    assert (stats["put_blocks"], stats["put_skipped_blocks"]) == (1, 1)


def test_a_block_missing_from_the_pool_fails_the_load(pair):
    reader = pair[2]
    assert not load(reader, "r2", ["a0", "never-put"], [11, 12])
    assert reader.get_stats().data["load_failures"] == 1


def test_kv_replicated_is_put_by_rank_0_alone_and_read_by_any_rank(master, pair):
    """MLA: the latent is the same on every rank, so rank 1 puts nothing and reads rank 0's copy."""
    writer, w_caches = pair[0], pair[1]
    rank1, r1_caches = worker(master, tp_rank=1, replicated=True)
    try:
        for t in r1_caches.values():
            t.copy_(torch.randn(SHAPE))
        rank1.start_load_kv(PoolConnectorMetadata(saves=[BlockTransfer("s", ["m0"], [3])]))
        rank1.wait_for_save()
        assert rank1.get_stats() is None  # no put, no existence check: nothing to count
        assert not load(rank1, "m1", ["m0"], [20])  # nobody has put it yet
        assert save(writer, ["m0"], [3])["put_blocks"] == 1  # rank 0's put
        assert load(rank1, "m2", ["m0"], [21])
        for name in w_caches:
            assert torch.equal(r1_caches[name][:, 21], w_caches[name][:, 3])
    finally:
        rank1.shutdown()


def test_a_get_refused_for_an_expired_lease_is_asked_again(pair, monkeypatch):
    """The store refuses a read that outlived the master's lease (-707) though the object may
    still be there: the load asks again and succeeds, and the retry is counted."""
    writer, _, reader, _ = pair
    save(writer, ["lease0", "lease1"], [30, 31])
    real_get, calls = reader._store.get, []

    def get_refused_once(keys, ranges):
        calls.append(list(keys))
        return [-707] * len(keys) if len(calls) == 1 else real_get(keys, ranges)

    monkeypatch.setattr(reader._store, "get", get_refused_once)
    assert load(reader, "r4", ["lease0", "lease1"], [32, 33])
    assert len(calls) == 2
    stats = reader.get_stats().data
    assert (stats["get_retries"], stats["load_failures"]) == (1, 0)


def test_a_get_refused_until_the_deadline_fails_the_load_at_the_deadline(pair, monkeypatch):
    reader = pair[2]
    monkeypatch.setattr(reader._store, "get", lambda keys, ranges: [-707] * len(keys))
    monkeypatch.setattr(
        reader, "_settings", reader._settings.model_copy(update={"load_timeout_s": 0.5})
    )
    start = time.monotonic()
    assert not load(reader, "r5", ["a0"], [14])
    assert time.monotonic() - start < 0.5 + 1.0
    stats = reader.get_stats().data
    # Asked again after a pause that grows (50, 100, 200 ms ...), not in a tight loop.
    assert stats["load_failures"] == 1 and 2 <= stats["get_retries"] <= 5


def test_a_full_pool_fails_puts_without_raising(pair):
    writer = pair[0]
    # 2 × 16 MiB mounted, 256 KiB a block: 200 blocks cannot all fit.
    stats = save(writer, [f"full{i}" for i in range(200)], [i % NUM_BLOCKS for i in range(200)])
    assert stats["put_failures"] > 0
    assert stats["put_blocks"] + stats["put_failures"] + stats["put_skipped_blocks"] == 200


def test_a_dead_master_fails_puts_at_once_and_loads_within_their_deadline(master, pair):
    writer, _, reader, _ = pair
    master.stop()
    # The first call after the master's death waits ~4.5 s in the store's RPC before it fails;
    # then PoolStore answers -900 itself for a while, and a step's puts must not wait at all.
    deadline = time.monotonic() + 15
    while min(writer._store.exists(["probe"])) >= 0:
        assert time.monotonic() < deadline, "the store client did not notice the dead master"
        time.sleep(0.1)
    start = time.monotonic()
    stats = save(writer, ["dead0", "dead1"], [1, 2])
    assert stats["put_failures"] == 2
    assert time.monotonic() - start < 0.5  # not the store's seconds of reconnecting
    assert not load(reader, "r3", ["a0"], [13], timeout_s=15)
    # The master back on its address for the workers' teardown: against a dead one, each
    # worker's close waits 10 s for its unmount RPC.
    again = start_mooncake_master(master.host, master.port, metadata_port=master.metadata_port)
    master.process = again.process  # the fixture stops this one


def test_a_hybrid_models_groups_go_through_the_pool_each_from_its_own_layers(master):
    """Layer 0 full attention (group 0), layer 1 sliding window (group 1): each group's block is
    a value of its own layer's K and V only, under the group's key."""
    groups = (KVGroup(("model.layers.0.attn",)), KVGroup(("model.layers.1.attn",), 128))
    (writer, w_caches), (reader, r_caches) = (worker(master, kv_groups=groups) for _ in range(2))
    try:
        for t in w_caches.values():
            t.copy_(torch.randn(SHAPE))
        writer.start_load_kv(PoolConnectorMetadata(saves=[
            BlockTransfer("s", ["h0", "h1"], [5, 6], group=0),
            BlockTransfer("s", ["h1"], [7], group=1),
        ]))  # fmt: skip
        writer.wait_for_save()
        stats = writer.get_stats().data
        assert (stats["put_blocks"], stats["put_bytes"]) == (3, 3 * BLOCK_BYTES // 2)
        assert writer._store.exists(block_keys(["h1"], 0, 1) + block_keys(["h1"], 0)) == [1, 0]
        reader.start_load_kv(PoolConnectorMetadata(loads=[
            BlockTransfer("r", ["h0", "h1"], [1, 2], group=0),
            BlockTransfer("r", ["h1"], [3], group=1),
        ]))  # fmt: skip
        deadline = time.monotonic() + 10
        while "r" not in (r := reader.get_transfer_results()).finished_recving:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "r" not in r.failed_recving
        full, sliding = (r_caches[f"model.layers.{i}.attn"] for i in range(2))
        assert torch.equal(full[:, 1:3], w_caches["model.layers.0.attn"][:, 5:7])
        assert torch.equal(sliding[:, 3], w_caches["model.layers.1.attn"][:, 7])
        assert not sliding[:, 1:3].any() and not full[:, 3].any()  # each group its own layers
        assert reader.get_stats().data["get_bytes"] == 3 * BLOCK_BYTES // 2
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_load_that_could_not_be_planned_is_reported_failed_with_its_reason(pair):
    reader = pair[2]
    reader.start_load_kv(PoolConnectorMetadata(loads=[BlockTransfer("bad", [], [1], error="no")]))
    deadline = time.monotonic() + 10
    while "bad" not in (r := reader.get_transfer_results()).finished_recving:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "bad" in r.failed_recving
