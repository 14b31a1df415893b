"""``MasterAway``: how long the pool client stops asking a master that did not answer."""

from mooncake_vllm.pool.store import MASTER_UNREACHABLE, MasterAway


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_quiet_after_an_unreachable_master_doubles_up_to_a_cap_and_resets_on_an_answer():
    clock = Clock()
    m = MasterAway(clock)
    assert not m.away()
    quiet = []
    for _ in range(7):
        m.record([0, MASTER_UNREACHABLE])
        start = clock.now
        while m.away():
            clock.now += 0.25
        quiet.append(clock.now - start)
    assert quiet == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    m.record([1, 0])  # the master answered
    m.record([MASTER_UNREACHABLE])
    clock.now += 1.0
    assert not m.away()  # back to the first, short quiet


def test_other_failures_do_not_silence_the_client():
    clock = Clock()
    m = MasterAway(clock)
    m.record([-200, -704, -707])
    assert not m.away()
