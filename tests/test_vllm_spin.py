"""``vllm_busy_loop_s``: our connectors shorten the spin of vLLM's real queue readers."""

import sys

import pytest
import zmq
from pydantic import ValidationError
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

from mooncake_vllm.p2p.config import MooncakeSettings
from mooncake_vllm.pool.config import PoolSettings
from mooncake_vllm.vllm_glue import shorten_gil_switch_interval, shorten_queue_spin

POOL = dict(master_server_address="127.0.0.1:50051", metadata_server="http://h:8080/metadata")


def _conditions(tmp_path):
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=address)
    reader = SpinCondition(is_reader=True, context=ctx, notify_address=address)
    return ctx, writer, reader


def test_readers_spin_for_the_setting_and_writers_are_left_alone(tmp_path):
    ctx, writer, reader = _conditions(tmp_path)
    try:
        assert reader.busy_loop_s == 1  # vLLM's own
        assert shorten_queue_spin(0.02) >= 1
        assert reader.busy_loop_s == 0.02
        assert writer.busy_loop_s == 0
    finally:
        ctx.destroy(linger=0)


def test_null_keeps_vllms_spin(tmp_path):
    ctx, _, reader = _conditions(tmp_path)
    try:
        assert shorten_queue_spin(None) == 0
        assert reader.busy_loop_s == 1
    finally:
        ctx.destroy(linger=0)


def test_both_connectors_default_to_a_short_spin_and_accept_null():
    assert MooncakeSettings().vllm_busy_loop_s == 0.02
    assert MooncakeSettings(vllm_busy_loop_s=None).vllm_busy_loop_s is None
    assert PoolSettings(**POOL).vllm_busy_loop_s == 0.02
    assert PoolSettings(**POOL, vllm_busy_loop_s=None).vllm_busy_loop_s is None


def test_a_spin_too_short_for_vllms_wake_ups_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="vllm_busy_loop_s"):
        MooncakeSettings(vllm_busy_loop_s=0)
    with pytest.raises(ValidationError, match="vllm_busy_loop_s"):
        PoolSettings(**POOL, vllm_busy_loop_s=0.001)


def test_the_gil_switch_interval_is_set_or_left_alone():
    before = sys.getswitchinterval()
    try:
        shorten_gil_switch_interval(None)
        assert sys.getswitchinterval() == before
        shorten_gil_switch_interval(MooncakeSettings().gil_switch_interval_s)
        assert sys.getswitchinterval() == pytest.approx(0.0002)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ValidationError, match="gil_switch_interval_s"):
        MooncakeSettings(gil_switch_interval_s=0)
