"""Per-client limits (``proxy.limits``): token buckets and in-flight counts on a fake clock."""

from __future__ import annotations

import pytest

from mooncake_vllm.proxy.limits import ClientLimits, ClientSlot, Refusal, default_burst


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _admitted(outcome: ClientSlot | Refusal) -> ClientSlot:
    assert isinstance(outcome, ClientSlot), outcome
    return outcome


def _refused(outcome: ClientSlot | Refusal, reason: str) -> Refusal:
    assert isinstance(outcome, Refusal), outcome
    assert outcome.reason == reason
    return outcome


def test_rate_allows_a_burst_then_one_request_per_token():
    clock = FakeClock()
    limits = ClientLimits(rate_per_s=2.0, burst=3, clock=clock)
    for _ in range(3):
        _admitted(limits.acquire("a")).release()
    refusal = _refused(limits.acquire("a"), "rate")
    assert refusal.retry_after_s == pytest.approx(0.5)  # one token at 2/s
    assert refusal.retry_after_header == "1"
    assert "--client-rate" in refusal.message
    clock.now_s += 0.25  # half a token: still refused, and told the rest
    assert _refused(limits.acquire("a"), "rate").retry_after_s == pytest.approx(0.25)
    clock.now_s += 0.25
    _admitted(limits.acquire("a")).release()
    _refused(limits.acquire("a"), "rate")
    clock.now_s += 60  # refills to the burst, not beyond
    for _ in range(3):
        _admitted(limits.acquire("a")).release()
    _refused(limits.acquire("a"), "rate")


def test_clients_have_their_own_buckets():
    limits = ClientLimits(rate_per_s=1.0, burst=1, clock=FakeClock())
    _admitted(limits.acquire("a"))
    _refused(limits.acquire("a"), "rate")
    _admitted(limits.acquire("b"))


def test_concurrency_counts_requests_in_flight_and_release_is_idempotent():
    limits = ClientLimits(max_concurrency=2, clock=FakeClock())
    first, second = _admitted(limits.acquire("a")), _admitted(limits.acquire("a"))
    refusal = _refused(limits.acquire("a"), "concurrency")
    assert refusal.retry_after_header == "1" and "--client-max-concurrency" in refusal.message
    _admitted(limits.acquire("b")).release()  # another client is not affected
    first.release()
    first.release()  # a second release gives nothing back twice
    third = _admitted(limits.acquire("a"))
    _refused(limits.acquire("a"), "concurrency")
    second.release()
    third.release()
    assert len(limits) == 0  # nothing in flight, no bucket: forgotten


def test_a_refusal_for_concurrency_takes_no_token():
    limits = ClientLimits(max_concurrency=1, rate_per_s=1.0, burst=2, clock=FakeClock())
    slot = _admitted(limits.acquire("a"))  # 1 token left
    for _ in range(5):
        _refused(limits.acquire("a"), "concurrency")
    slot.release()
    _admitted(limits.acquire("a")).release()  # the token is still there
    _refused(limits.acquire("a"), "rate")


def test_a_slot_handed_over_is_released_by_its_new_owner_only():
    limits = ClientLimits(max_concurrency=1, clock=FakeClock())
    slot = _admitted(limits.acquire("a"))
    slot.hand_over()  # a stream took it
    slot.release_unless_handed_over()  # the request's end: no effect
    _refused(limits.acquire("a"), "concurrency")
    slot.release()  # the stream's end
    _admitted(limits.acquire("a"))


@pytest.mark.parametrize(
    ("retry_after_s", "header"), [(0.01, "1"), (1.0, "1"), (1.01, "2"), (7.5, "8")]
)
def test_retry_after_is_whole_seconds_rounded_up(retry_after_s, header):
    assert Refusal("rate", retry_after_s, "m").retry_after_header == header


@pytest.mark.parametrize(("rate", "burst"), [(None, 1), (0.1, 1), (1.0, 1), (2.5, 3), (50, 50)])
def test_default_burst_is_one_seconds_worth(rate, burst):
    assert default_burst(rate) == burst
    assert ClientLimits(rate_per_s=rate).burst == burst


def test_idle_clients_are_forgotten_once_their_bucket_is_full():
    clock = FakeClock()
    limits = ClientLimits(rate_per_s=1.0, burst=2, clock=clock)
    for i in range(100):
        _admitted(limits.acquire(f"10.0.0.{i}")).release()
    assert len(limits) == 100  # each owes a token
    clock.now_s += 1.0  # every bucket full again
    for i in range(100):
        _admitted(limits.acquire(f"10.1.0.{i}")).release()
    # Each acquire looked at a few of the oldest and forgot the ones that are full again.
    assert len(limits) <= 100
    assert not any(f"10.0.0.{i}" in limits._clients for i in range(100))


def test_many_addresses_stay_within_the_bound_and_busy_clients_are_kept():
    clock = FakeClock()
    limits = ClientLimits(max_concurrency=4, rate_per_s=0.001, burst=1, clock=clock, max_clients=50)
    busy = _admitted(limits.acquire("busy"))
    for i in range(10_000):  # buckets refill in 1000 s: none is forgettable by itself
        _admitted(limits.acquire(f"addr {i}")).release()
        assert len(limits) <= 51
    assert "busy" in limits._clients  # still counted while its request runs
    busy.release()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_concurrency"):
        ClientLimits(max_concurrency=0)
    with pytest.raises(ValueError, match="rate_per_s"):
        ClientLimits(rate_per_s=0)
    with pytest.raises(ValueError, match="burst"):
        ClientLimits(rate_per_s=1, burst=0)
