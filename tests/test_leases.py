"""Producer leases: hold, acquire, release, expiry, the kv_buffer_size budget; and the
consumer's block pins that keep blocks under a pull from reuse."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from vllm.v1.core.block_pool import BlockPool

from mooncake_vllm.core.loads import BlockPins
from mooncake_vllm.p2p.leases.table import NOT_YET, Lease, LeaseState, LeaseTable, NotOwner
from mooncake_vllm.p2p.protocol import ALL_LAYERS

# ---- leases ---------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _table(clock, ttl_s=10.0, budget_bytes=1000, pull_hold_s=5.0) -> LeaseTable:
    return LeaseTable(ttl_s, budget_bytes, pull_hold_s, clock=clock)


@dataclass(frozen=True)
class Handoff:
    """What the table reads of a lease's handoff."""

    prompt_digest: str


# Owner tokens of three consumer pulls (random 16 bytes in the worker).
A, B, C = (bytes([i]) * 16 for i in (1, 2, 3))


def test_hold_acquire_release(clock):
    t = _table(clock)
    t.add("req-1", "t-1", [3, 4], nbytes=100)
    assert (t.held_count, t.held_bytes) == (1, 100)
    assert t.take_finished() == set()  # held blocks are not freed

    lease = t.acquire("t-1", [3, 4], A)
    assert lease.state is LeaseState.PULLING
    assert (lease.req_id, lease.block_ids) == ("req-1", [3, 4])

    assert t.release("t-1", A) is True
    assert lease.state is LeaseState.ENDED
    assert lease.end_reason == "released"
    assert (t.held_count, t.held_bytes) == (0, 0)
    assert t.take_finished() == {"req-1"}
    assert t.take_finished() == set()  # reported once
    assert t.ended_counts == {"released": 1}


def test_a_pending_acquire_is_granted_only_the_lease_of_its_own_prompt(clock):
    """A transfer id sent with two requests: the decode of the other prompt is refused, naming
    the id, and the lease stays for the decode of its own prompt."""
    t = _table(clock)
    tid = "xfer-3f2b8c1e-9d4a-4e6f-8b1c-2a3d4e5f6a7b"
    t.add("req-1", tid, [3, 4], 100, handoff=Handoff(prompt_digest="aa"))
    refused = t.acquire(tid, [], A, pending=True, prompt_digest="bb")
    assert refused == (
        "transfer_id xfer-3f2b8c1e holds another prompt's KV: it was used for two requests "
        "(choose a new transfer_id for every request)"
    )
    assert t.acquire(tid, [], B, pending=True, prompt_digest="aa").owners == {B}


def test_a_pending_acquire_without_a_prompt_digest_gets_only_a_lease_bound_to_none(clock):
    # The transfer id alone buys nothing of a prompt's KV; a prompt of embeddings has no digest
    # on either side.
    t = _table(clock)
    t.add("req-1", "t-1", [3, 4], 100, handoff=Handoff(prompt_digest="aa"))
    t.add("req-2", "t-2", [5], 100, handoff=Handoff(prompt_digest=""))
    assert "names none: send the request's prompt_digest" in t.acquire("t-1", [], A, pending=True)
    assert isinstance(t.acquire("t-2", [], A, pending=True), Lease)


# ---- leases opened while their prefill computes (layerwise_handoff) ---------------------------


def _computing(clock, marks_needed=1) -> LeaseTable:
    t = LeaseTable(10.0, 1000, 5.0, clock=clock, marks_needed=marks_needed)
    t.add("req-1", "t-1", [3, 4], 100, handoff="h", computing=True, layers=3)
    return t


def test_a_computing_lease_is_granted_only_to_pending_acquires_that_take_layers(clock):
    t = _computing(clock)
    assert t.acquire("t-1", [3, 4], A) is NOT_YET  # not for a consumer that waits for the end
    assert t.acquire("t-1", [], A, pending=True) is NOT_YET
    lease = t.acquire("t-1", [], B, pending=True, layers_ok=True)
    assert lease.state is LeaseState.PULLING and lease.ready == 0
    # A second producer rank's lease, acquired with the handoff the first rank granted.
    t2 = _computing(clock)
    assert t2.acquire("t-1", [3, 4], B, layers_ok=True).ready == 0
    # Its blocks belong to the running request: no budget, no held bytes, never evicted.
    assert t.held_bytes == 0
    t.add("req-2", "t-2", [5], 1000)
    assert t.is_live("t-1") and t.is_live("t-2")


def test_layers_are_ready_once_every_rank_wrote_them_and_all_once_all_are(clock):
    t = _computing(clock, marks_needed=2)
    t.acquire("t-1", [], A, pending=True, layers_ok=True)
    assert t.mark("t-1", 1) and t.progress("t-1", A) == 0  # one rank of two
    t.mark("t-1", 1)
    t.mark("t-1", 0)
    assert t.progress("t-1", A) == 0b010
    assert not t.mark("t-1", 7) and not t.mark("t-9", 0)  # no such layer or lease
    assert t.progress("t-1", B) == "transfer t-1 was not acquired by this peer"
    for layer in (0, 2, 2):
        t.mark("t-1", layer)
    # Every layer written in the request's last step: complete, while it still computes.
    assert t.progress("t-1", A) == ALL_LAYERS and t.held_bytes == 0
    t.add("req-1", "t-1", [3, 4], 100)  # the request finished: its blocks are held now
    assert t.progress("t-1", A) == ALL_LAYERS and t.held_bytes == 100
    assert not t.mark("t-1", 2)
    t.release("t-1", A)
    assert t.take_finished() == {"req-1"}


def test_a_lease_opened_computing_is_complete_once_its_request_finished(clock):
    t = _computing(clock)  # a layer whose marks never came: the finish completes it
    t.acquire("t-1", [], A, pending=True, layers_ok=True)
    t.mark("t-1", 0)
    assert t.progress("t-1", A) == 0b001
    t.add("req-1", "t-1", [3, 4], 100)
    assert t.progress("t-1", A) == ALL_LAYERS


def test_a_lease_read_before_its_request_finished_is_freed_only_when_it_does(clock):
    t = _computing(clock)
    t.acquire("t-1", [], A, pending=True, layers_ok=True)
    t.release("t-1", A)
    assert not t.is_live("t-1")
    assert t.take_finished() == set()  # the request still runs on these blocks
    t.add("req-1", "t-1", [3, 4], 100)
    assert t.take_finished() == {"req-1"} and not t.is_live("t-1")


def test_an_aborted_prefill_refuses_its_reader_and_frees_after_its_release(clock):
    t = _computing(clock)
    t.acquire("t-1", [], A, pending=True, layers_ok=True)
    t.abort("req-1", "t-1")
    assert "ended without a handover" in t.progress("t-1", A)
    assert "ended without a handover" in t.acquire("t-1", [], B, pending=True, layers_ok=True)
    assert t.take_finished() == set()  # the reader may still be reading
    t.release("t-1", A, ok=False)
    assert t.take_finished() == {"req-1"}


def test_an_aborted_prefill_nobody_acquired_is_freed_at_once(clock):
    t = _computing(clock)
    t.abort("req-1", "t-1")
    assert t.take_finished() == {"req-1"} and t.ended_reason("t-1") == "aborted"
    t2 = _computing(clock)
    clock.now_s += 11  # expired while computing: freed once the request ends
    t2.expire()
    assert t2.take_finished() == set()
    t2.abort("req-1", "t-1")
    assert t2.take_finished() == {"req-1"}


def test_acquire_of_unknown_id_is_not_refused_yet(clock):
    # The handoff may reach the consumer before the producer's worker registers the lease.
    assert _table(clock).acquire("t-unknown", [1], A) is None


def test_a_replicated_latent_lease_serves_every_reader_and_ends_with_the_last(clock):
    # MLA, decode TP2: both decode ranks pull the same lease; it stays pinned until both release.
    t = _table(clock)
    t.add("req-1", "t-1", [3, 4], nbytes=100, max_readers=2)
    first = t.acquire("t-1", [3, 4], A, readers=2)
    assert first.state is LeaseState.PULLING
    assert t.acquire("t-1", [3, 4], B, readers=2) is first
    assert t.acquire("t-1", [3, 4], C, readers=2) == "transfer t-1 is already being pulled"
    assert t.release("t-1", A) is True
    assert first.state is LeaseState.PULLING  # the other reader may still be reading
    assert t.take_finished() == set()
    assert t.release("t-1", B, ok=False) is True
    assert (first.state, first.end_reason) == (LeaseState.ENDED, "pull failed")
    assert t.take_finished() == {"req-1"}


def test_a_reader_that_never_comes_leaves_the_lease_to_its_pull_deadline(clock):
    t = _table(clock, pull_hold_s=5.0)
    t.add("req-1", "t-1", [3], nbytes=100, max_readers=2)
    t.acquire("t-1", [3], A, readers=2)
    t.release("t-1", A)
    clock.now_s += 5.0
    t.expire()
    assert t.take_finished() == {"req-1"}
    assert t.ended_counts == {"expired": 1}


@pytest.mark.parametrize(
    "block_ids",
    [
        [4, 5],  # part of the lease (was granted before owner tokens: now the hold's blocks only)
        [3, 4, 5, 6],  # more than the lease
        [4, 7],  # blocks outside the lease
        [5, 4, 3],  # the lease's blocks in another order
        [3, 3, 4, 5],
        [],
    ],
)
def test_an_acquire_must_name_exactly_the_holds_blocks(clock, block_ids):
    t = _table(clock)
    t.add("req-1", "t-1", [3, 4, 5], nbytes=100)
    assert t.acquire("t-1", block_ids, A) == "transfer t-1: the blocks are not the lease's"
    lease = t.acquire("t-1", [3, 4, 5], A)  # the lease itself is intact, A not yet an owner
    assert lease.state is LeaseState.PULLING and lease.owners == {A}


def test_second_acquire_while_pulling_is_refused(clock):
    t = _table(clock)
    t.add("req-1", "t-1", [3], nbytes=100)
    t.acquire("t-1", [3], A)
    assert t.acquire("t-1", [3], B) == "transfer t-1 is already being pulled"
    assert t.acquire("t-1", [3], A) == "transfer t-1 is already being pulled"  # A again too


def test_release_of_unknown_id(clock):
    t = _table(clock)
    assert t.release("t-unknown", A) is False
    assert t.take_finished() == set()


def test_held_lease_expires_after_ttl(clock):
    t = _table(clock, ttl_s=10.0)
    t.add("req-1", "t-1", [3], nbytes=100)
    clock.now_s += 9.9
    t.expire()
    assert t.held_count == 1
    clock.now_s += 0.1
    t.expire()
    assert t.held_count == 0
    assert t.take_finished() == {"req-1"}
    assert t.ended_counts == {"expired": 1}


def test_pulling_lease_expires_at_its_pull_deadline_not_its_ttl(clock):
    t = _table(clock, ttl_s=10.0, pull_hold_s=30.0)
    t.add("req-1", "t-1", [3], nbytes=100)
    clock.now_s += 9.0
    t.acquire("t-1", [3], A)  # pull deadline: now + 30
    clock.now_s += 20.0  # past the TTL
    t.expire()
    assert t.held_count == 1
    clock.now_s += 10.0
    t.expire()
    assert t.held_count == 0
    assert t.take_finished() == {"req-1"}


@pytest.mark.parametrize("end", ["release", "expire", "evict"])
def test_pull_of_an_ended_lease_is_refused_with_the_reason(clock, end):
    t = _table(clock, ttl_s=10.0, budget_bytes=150)
    t.add("req-1", "t-1", [3], nbytes=100)
    if end == "release":
        t.acquire("t-1", [3], A)  # only an owner can release it
        t.release("t-1", A)
        reason = "released"
    elif end == "expire":
        clock.now_s += 10.0
        t.expire()
        reason = "expired"
    else:
        t.add("req-2", "t-2", [4], nbytes=100)
        reason = "evicted"
    assert t.acquire("t-1", [3], B) == f"transfer t-1 already {reason}"
    assert "req-1" in t.take_finished()


def test_budget_evicts_oldest_first(clock):
    t = _table(clock, budget_bytes=300)
    for i in range(3):
        t.add(f"req-{i}", f"t-{i}", [i], nbytes=100)
    assert (t.held_count, t.take_finished()) == (3, set())  # exactly at budget

    t.add("req-3", "t-3", [3], nbytes=150)  # 450 held: the two oldest go
    assert t.held_bytes == 250
    assert t.take_finished() == {"req-0", "req-1"}
    assert t.acquire("t-0", [0], A) == "transfer t-0 already evicted"
    assert t.acquire("t-2", [2], A).state is LeaseState.PULLING
    assert t.ended_counts == {"evicted": 2}


def test_budget_never_evicts_a_lease_being_pulled(clock):
    t = _table(clock, budget_bytes=200)
    t.add("req-0", "t-0", [0], nbytes=100)
    t.add("req-1", "t-1", [1], nbytes=100)
    t.acquire("t-0", [0], A)
    t.add("req-2", "t-2", [2], nbytes=100)  # oldest is pulling: the next oldest held one goes
    assert t.take_finished() == {"req-1"}
    assert t.release("t-0", A) is True


def test_lease_larger_than_the_budget_is_freed_at_once(clock):
    t = _table(clock, budget_bytes=100)
    t.add("req-0", "t-0", [0], nbytes=500)
    assert t.held_count == 0
    assert t.take_finished() == {"req-0"}  # its blocks are freed, not leaked


def test_duplicate_transfer_id_supersedes_the_older_lease(clock):
    t = _table(clock)
    t.add("req-old", "t-1", [3, 4], nbytes=100)
    t.add("req-new", "t-1", [7, 8], nbytes=100)
    assert (t.held_count, t.held_bytes) == (1, 100)
    assert t.take_finished() == {"req-old"}  # the older request's blocks are freed
    assert t.ended_counts == {"superseded": 1}

    assert t.acquire("t-1", [3, 4], A) == "transfer t-1: the blocks are not the lease's"
    lease = t.acquire("t-1", [7, 8], A)
    assert lease.req_id == "req-new"
    assert t.acquire("t-1", [7, 8], B) == "transfer t-1 is already being pulled"
    t.release("t-1", A)
    assert t.take_finished() == {"req-new"}


def test_superseding_lease_restarts_the_budget_order(clock):
    t = _table(clock, budget_bytes=200)
    t.add("req-a", "t-a", [0], nbytes=100)
    t.add("req-b", "t-b", [1], nbytes=100)
    t.add("req-a2", "t-a", [2], nbytes=100)  # t-a is now the newest
    assert t.take_finished() == {"req-a"}
    t.add("req-c", "t-c", [3], nbytes=100)
    assert t.take_finished() == {"req-b"}  # oldest remaining, not the re-added t-a


def test_ended_ids_are_remembered_up_to_a_bound(clock):
    t = LeaseTable(10.0, 10_000, 5.0, clock=clock, remember_ended=2)
    for i in range(3):
        t.add(f"req-{i}", f"t-{i}", [i], nbytes=1)
        t.acquire(f"t-{i}", [i], A)
        t.release(f"t-{i}", A)
    assert t.acquire("t-0", [0], B) is None  # forgotten: the side channel treats it as unknown
    assert t.acquire("t-2", [2], B) == "transfer t-2 already released"


def test_real_clock_with_a_tiny_ttl():
    t = LeaseTable(ttl_s=0.0, budget_bytes=1000, pull_hold_s=1.0)
    t.add("req-1", "t-1", [3], nbytes=100)
    t.expire()
    assert t.take_finished() == {"req-1"}


# ---- ownership: only a peer that acquired a lease can end it ---------------------------------


def test_a_release_from_a_peer_that_never_acquired_changes_nothing(clock):
    t = _table(clock)
    t.add("req-1", "t-1", [3, 4], nbytes=100)
    lease = t.acquire("t-1", [3, 4], A)
    with pytest.raises(NotOwner):
        t.release("t-1", B)
    with pytest.raises(NotOwner):
        t.release("t-1", B, ok=False)  # nor marks the pull failed
    assert (lease.state, t.held_count, t.take_finished()) == (LeaseState.PULLING, 1, set())
    assert t.release("t-1", A) is True  # the owner still can
    assert (lease.state, lease.end_reason) == (LeaseState.ENDED, "released")
    assert t.take_finished() == {"req-1"}


def test_a_held_lease_cannot_be_released_without_acquiring_it(clock):
    # Before owner tokens a release of a HELD lease ended it at once; now the consumer that
    # needs nothing acquires first (the worker's give-back), and a stranger's release is refused.
    t = _table(clock, ttl_s=10.0)
    t.add("req-1", "t-1", [3], nbytes=100)
    with pytest.raises(NotOwner):
        t.release("t-1", A)
    assert (t.held_count, t.take_finished(), t.ended_counts) == (1, set(), {})
    clock.now_s += 10.0
    t.expire()  # the TTL still frees it
    assert (t.take_finished(), t.ended_counts) == ({"req-1"}, {"expired": 1})


def test_a_release_is_idempotent_per_owner(clock):
    # A retried release (its reply lost) must not count as the other reader's.
    t = _table(clock)
    t.add("req-1", "t-1", [3], nbytes=100, max_readers=2)
    lease = t.acquire("t-1", [3], A, readers=2)
    t.acquire("t-1", [3], B, readers=2)
    assert t.release("t-1", A) is True
    assert t.release("t-1", A, ok=False) is True  # again: neither counted nor marked failed
    assert (lease.state, t.take_finished()) == (LeaseState.PULLING, set())
    assert t.release("t-1", B) is True
    assert (lease.state, lease.end_reason) == (LeaseState.ENDED, "released")
    assert t.release("t-1", B) is False  # ended: nothing to do
    assert t.release("t-1", C) is False  # nor for a stranger (no NotOwner once it ended)
    assert t.ended_counts == {"released": 1}


@pytest.mark.parametrize(
    ("max_readers", "readers"),
    [(1, 0), (1, 2), (2, 3), (2, -1), (64, 65)],
)
def test_readers_outside_the_holds_bound_are_refused(clock, max_readers, readers):
    t = _table(clock)
    t.add("req-1", "t-1", [3], nbytes=100, max_readers=max_readers)
    assert t.acquire("t-1", [3], A, readers=readers) == (
        f"readers={readers} outside 1..{max_readers}"
    )
    assert t.acquire("t-1", [3], A, readers=max_readers).state is LeaseState.PULLING


def test_readers_are_fixed_by_the_first_acquire(clock):
    t = _table(clock)
    t.add("req-1", "t-1", [3], nbytes=100, max_readers=4)
    lease = t.acquire("t-1", [3], A, readers=2)
    for readers in (1, 3, 4):  # neither fewer (ending it early) nor more (pinning it longer)
        assert t.acquire("t-1", [3], B, readers=readers) == (
            f"readers={readers}, the lease was acquired for 2"
        )
    assert (lease.readers, lease.owners) == (2, {A})
    assert t.acquire("t-1", [3], B, readers=2) is lease


def test_one_owner_cannot_take_two_shares_of_a_shared_lease(clock):
    t = _table(clock)
    t.add("req-1", "t-1", [3], nbytes=100, max_readers=2)
    lease = t.acquire("t-1", [3], A, readers=2)
    assert t.acquire("t-1", [3], A, readers=2) == "transfer t-1 is already being pulled"
    t.release("t-1", A)
    assert lease.state is LeaseState.PULLING  # A alone cannot end a lease of two readers
    assert t.acquire("t-1", [3], B, readers=2) is lease
    assert t.acquire("t-1", [3], C, readers=2) == "transfer t-1 is already being pulled"
    t.release("t-1", B)
    assert lease.state is LeaseState.ENDED


def test_a_refusal_shows_only_a_prefix_of_the_transfer_id(clock):
    # Refusals travel back to any peer and into logs: never the whole id that names the lease.
    t = _table(clock)
    tid = "0123456789abcdef" * 2
    t.add("req-1", tid, [3], nbytes=100)
    reason = t.acquire(tid, [4], A)
    assert "01234567" in reason and tid not in reason
    t.acquire(tid, [3], A)
    assert tid not in t.acquire(tid, [3], B)
    t.release(tid, A)
    assert t.acquire(tid, [3], B) == "transfer 01234567 already released"


def test_blocks_under_a_pull_are_not_reused_until_every_rank_settled():
    pool = BlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=16)
    free0 = pool.get_num_free_blocks()
    blocks = pool.get_new_blocks(3)  # the request's allocation
    pins = BlockPins(pool, tp_size=2)
    pins.pin("req-1", [b.block_id for b in blocks])
    pool.free_blocks(blocks)  # vLLM fails the request at the deadline and frees its blocks
    assert pool.get_num_free_blocks() == free0 - 3  # still pinned: not handed out again
    pins.settle(["req-1", "req-unknown"])  # rank 0 settled
    assert (pool.get_num_free_blocks(), len(pins)) == (free0 - 3, 1)
    pins.settle(["req-1"])  # rank 1 settled: every entry has ended
    assert (pool.get_num_free_blocks(), len(pins)) == (free0, 0)
