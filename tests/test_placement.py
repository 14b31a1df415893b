"""harness.placement: each engine of one host on its own cores."""

import pytest

from harness import placement


def test_split_cores_gives_each_engine_its_own_and_keeps_one_back_when_spare():
    assert placement.split_cores(2, [0, 1]) == [[0], [1]]
    assert placement.split_cores(2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert placement.split_cores(2, list(range(8))) == [[1, 2, 3], [4, 5, 6]]
    assert placement.split_cores(1, [4, 5, 6]) == [[5, 6]]
    with pytest.raises(ValueError, match="3 cores cannot give 4 engines"):
        placement.split_cores(4, [0, 1, 2])


def test_bind_env_uses_vllms_range_syntax():
    assert placement.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert placement.bind_env([3]) == {"VLLM_CPU_OMP_THREADS_BIND": "3", "OMP_NUM_THREADS": "1"}
