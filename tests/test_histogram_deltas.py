"""What the benchmarks read from two readings of a Prometheus histogram (pure functions)."""

import math

import pytest

from harness.servers import histogram_count_above, histogram_quantile

INF = float("inf")
BEFORE = {0.001: 1, 0.005: 2, 0.01: 2, INF: 3}
AFTER = {0.001: 3, 0.005: 6, 0.01: 8, INF: 10}  # between them: 2, 2, 2 and 1 per bucket


def test_the_quantile_is_the_upper_bound_of_its_bucket_among_the_new_observations():
    assert histogram_quantile(BEFORE, AFTER, 0.25) == 0.001
    assert histogram_quantile(BEFORE, AFTER, 0.5) == 0.005
    assert histogram_quantile(BEFORE, AFTER, 0.99) == INF


def test_observations_above_a_bound_count_only_the_new_ones():
    assert histogram_count_above(BEFORE, AFTER, 0.005) == 3
    assert histogram_count_above(BEFORE, AFTER, 0.01) == 1
    assert histogram_count_above({}, AFTER, 0.001) == 7  # since the start


def test_an_unread_histogram_gives_nan_and_a_bound_that_is_no_bucket_is_an_error():
    assert math.isnan(histogram_count_above({}, {}, 0.005))
    assert math.isnan(histogram_quantile(AFTER, AFTER, 0.5))
    with pytest.raises(ValueError, match="not a bucket bound"):
        histogram_count_above(BEFORE, AFTER, 0.002)
