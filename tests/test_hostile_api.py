"""Hostile ``kv_transfer_params`` against the scheduler half's hooks, in-process (issue 47).

vLLM calls these hooks inside ``schedule()`` with no handler around them: an exception from
one ends the engine core and every request on it. A decode's OpenAI API takes any JSON object
as ``kv_transfer_params``; ``transfer_id`` a dict once raised ``TypeError: unhashable type``
there. Every hook is driven here with fuzzed params (hypothesis) in vLLM's call order, on a
consumer and on a producer: none raises, a request that asks for a remote prefill is either
planned or refused through the policy with a message naming the field, and nothing is left
behind. ``tests/test_hostile_api_e2e.py`` sends the same to a real decode.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_half import (
    BLOCK,
    STEP,
    Blocks,
    consumer,  # noqa: F401 (a fixture)
    handoff_params,
    producer,  # noqa: F401
    request,
)
from vllm.v1.request import RequestStatus

from mooncake_vllm.p2p.params import ParamTypes, param_type_error

FIELDS = list(ParamTypes.__struct_fields__)
# JSON values of every type, nested a little.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
WRONG = [{}, {"a": 1}, [], [1, "x"], 7, -1, 2.5, "7", None, True]

_ids = itertools.count()
_hex = (f"{i:032x}" for i in itertools.count(1))


def _params(base: dict, changes: dict) -> dict:
    return {**base, **changes}


def _run_consumer(half, params, prompt_len: int = 300):
    """vLLM's order for one request on a consumer: match, allocate, step, finish."""
    req = request(f"r{next(_ids)}", prompt_len, params)
    count, is_async = half.get_num_new_matched_tokens(req, 0)
    n = -(-prompt_len // BLOCK)
    half.update_state_after_alloc(req, Blocks(list(range(10, 10 + n))), count or 0)
    loads = half.build_connector_meta(STEP).loads
    half.request_finished(req, list(range(10, 10 + n)))
    return count, is_async, loads


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(changes=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4))
def test_no_consumer_hook_raises_on_any_params(consumer, changes):  # noqa: F811
    base = handoff_params(300, transfer_id="a" * 32)
    params = _params(base, changes)
    error = param_type_error(params)  # before the hooks: they turn do_remote_prefill off
    count, _, loads = _run_consumer(consumer, params)
    if error is not None and count:
        (load,) = loads
        assert load.error == error and load.handoff is None  # refused, naming the field


@settings(max_examples=100, deadline=None)
@given(params=JSON)
def test_params_of_any_json_shape_never_raise(params):
    from test_scheduler_half import SchedulerHalf, load_settings, resolve

    half = SchedulerHalf(
        resolve(load_settings({"decode_url": "127.0.0.1:17000"}, env={}), "kv_consumer", "d", 1),
        BLOCK,
        "c" * 64,
    )
    try:
        _run_consumer(half, params)
    finally:
        half.shutdown()


def test_a_wrongly_typed_field_is_refused_through_the_policy_naming_it(consumer):  # noqa: F811
    """Each field the connector reads, given each JSON type, one request each."""
    refused = 0
    for field, value in itertools.product(FIELDS, WRONG):
        params = _params(handoff_params(300, transfer_id=next(_hex)), {field: value})
        error = param_type_error(params)
        count, is_async, loads = _run_consumer(consumer, params)
        if error is None:
            continue  # the right type after all (null, or a bool where one is taken)
        case = f"{field}={value!r}"
        if field == "do_remote_prefill" and value is False:
            assert count == 0 and loads == [], case
            continue
        assert (count, is_async) == (300, True), case
        (load,) = loads
        assert f"$.{field}" in load.error, (case, load.error)
        assert load.handoff is None and load.local_block_ids == [10, 11, 12], case
        refused += 1
    assert refused >= len(FIELDS) * 6  # every field took at least six of the wrong types


def test_an_unhashable_transfer_id_no_longer_raises(consumer):  # noqa: F811
    """What ended a decode engine: ``transfer_id`` a dict or a list."""
    for value in ({"x": 1}, [1, 2]):
        count, _, (load,) = _run_consumer(
            consumer, _params(handoff_params(300), {"transfer_id": value})
        )
        assert count == 300 and "$.transfer_id" in load.error


def test_upstreams_decode_leg_with_wrong_types_is_computed_naming_the_field(
    consumer,  # noqa: F811
    caplog,
):
    """As vLLM's upstream connector: a decode leg of its convention whose transfer id, engine
    id or bootstrap address cannot be used is not claimed (the decode computes the prompt);
    the warning names the field."""
    upstream = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "xfer-6f1f5e0a-1b2c-4d3e-8f40-5a6b7c8d9e0f",
        "remote_engine_id": "prefill",
        "remote_bootstrap_addr": "http://127.0.0.1:8998",
    }
    for field, value in [("remote_engine_id", ["p"]), ("remote_bootstrap_addr", {"h": 1}),
                         ("transfer_id", {"x": 1})]:  # fmt: skip
        caplog.clear()
        count, _, loads = _run_consumer(consumer, _params(upstream, {field: value}))
        assert (count, loads) == (0, [])
        assert "not pulled, the prompt is computed here" in caplog.text, field
        assert field in caplog.text


def test_a_connector_error_in_a_hook_is_refused_through_the_policy_not_raised(
    consumer,  # noqa: F811
    monkeypatch,
):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(consumer, "_check", broken)
    count, is_async, (load,) = _run_consumer(consumer, handoff_params(300, transfer_id="c" * 32))
    assert (count, is_async) == (300, True)
    assert "a bug of ours" in load.error and load.local_block_ids == [10, 11, 12]
    monkeypatch.setattr(consumer, "_matched_tokens", broken)
    count, is_async, (load,) = _run_consumer(consumer, handoff_params(300, transfer_id="d" * 32))
    assert (count, is_async) == (300, True) and "a bug of ours" in load.error


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(changes=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=3))
def test_no_producer_hook_raises_and_a_wrongly_typed_request_is_not_handed_over(producer, changes):  # noqa: F811
    params = {"do_remote_decode": True, "transfer_id": "e" * 32, **changes}
    req = request(
        f"p{next(_ids)}",
        300,
        params,
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        computed=300,
    )
    producer.get_num_new_matched_tokens(req, 0)
    producer.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    producer.build_connector_meta(STEP)
    error = param_type_error(params)
    delay, answer = producer.request_finished(req, [1, 2, 3])
    if error is not None:
        assert (delay, answer) == (False, None)
