"""The contract with vLLM, pinned without a server: the signatures of every ``KVConnectorBase_V1``
hook our connectors override, and the internals ``vllm_glue`` probes. A vLLM upgrade that changes
any of them fails here, in CI, not in a user's cluster."""

from __future__ import annotations

import inspect
import threading
import types

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from mooncake_vllm import vllm_glue
from mooncake_vllm.connector import MooncakeConnector
from mooncake_vllm.pool.connector import MooncakeStoreConnector

# Hook → its parameters in the tested vLLM (0.32). Ours must take the same.
HOOKS = {
    "bind_gpu_block_pool": ["self", "gpu_block_pool"],
    "build_connector_meta": ["self", "scheduler_output"],
    "build_connector_worker_meta": ["self"],
    "build_kv_connector_stats": ["data"],
    "build_prom_metrics": ["vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"],
    "get_finished": ["self", "finished_req_ids"],
    "get_handshake_metadata": ["self"],
    "get_kv_connector_stats": ["self"],
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "get_transfer_results": ["self", "finished_req_ids"],
    "has_pending_push_work": ["self"],
    "register_kv_caches": ["self", "kv_caches"],
    "request_finished": ["self", "request", "block_ids"],
    "save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "set_xfer_handshake_metadata": ["self", "metadata"],
    "shutdown": ["self"],
    "start_load_kv": ["self", "forward_context", "kwargs"],
    "update_connector_output": ["self", "connector_output"],
    "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    "wait_for_layer_load": ["self", "layer_name"],
    "wait_for_save": ["self"],
}


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _overridden(cls) -> list[str]:
    """Hooks of vLLM's base class that ``cls`` or one of our bases (``HalvesConnector``) define."""
    ours = [c for c in cls.__mro__ if c.__module__.startswith("mooncake_vllm")]
    return sorted(
        n
        for c in ours
        for n, v in vars(c).items()
        if hasattr(KVConnectorBase_V1, n)
        and not n.startswith("_")
        and (callable(v) or isinstance(v, classmethod | staticmethod))
    )


@pytest.mark.parametrize("cls", [MooncakeConnector, MooncakeStoreConnector])
def test_every_hook_we_override_is_pinned_and_matches_vllms(cls):
    for name in _overridden(cls):
        assert name in HOOKS, f"{cls.__name__}.{name} overrides a hook this test does not pin"
        assert _params(getattr(KVConnectorBase_V1, name)) == HOOKS[name], (
            f"vLLM changed KVConnectorBase_V1.{name}"
        )
        ours = getattr(cls, name)
        assert _params(ours) == HOOKS[name], f"{cls.__name__}.{name} differs from vLLM's hook"


def test_the_installed_vllm_is_tested_and_every_internal_probes():
    found = vllm_glue.probe_internals()
    assert vllm_glue.is_tested(found.version), found.version
    assert found.failures == {}


def test_an_untested_vllm_stops_the_engine_naming_what_changed(monkeypatch):
    broken = vllm_glue.Probe("0.99.1", {"queue_spin": "SpinCondition has no busy_loop_s"})
    monkeypatch.setattr(vllm_glue, "_checked", broken)
    with pytest.raises(vllm_glue.VllmIncompatible) as e:
        vllm_glue.check_vllm(allow_untested=False)
    for said in ("0.99.1", "tested: 0.32.x", "no busy_loop_s", "allow_untested_vllm"):
        assert said in str(e.value)
    # Opted in: it runs, and what failed falls back (no spin change, no resting).
    assert vllm_glue.check_vllm(allow_untested=True) is broken
    assert vllm_glue.shorten_queue_spin(0.02) == 0
    assert vllm_glue.EngineCoreHandle.find(broken) is None


def _core(running=(), waiting=(), finished=()):
    from vllm.v1.request import RequestStatus

    def req(rid, status):
        return types.SimpleNamespace(request_id=rid, status=status)

    sched = types.SimpleNamespace(
        running=list(running),
        waiting=[req(r, s) for r, s in waiting],
        finished_recving_kv_req_ids=set(finished),
    )
    return vllm_glue.EngineCoreHandle(types.SimpleNamespace(scheduler=sched)), RequestStatus


def test_the_engine_core_is_idle_only_when_every_waiting_request_waits_for_us():
    handle, st = _core()
    assert not handle.busy_with_others()
    handle, st = _core(waiting=[("a", None)])
    handle._core.scheduler.waiting[0].status = st.WAITING_FOR_REMOTE_KVS
    assert not handle.busy_with_others()
    handle._core.scheduler.waiting[0].status = st.WAITING
    assert handle.busy_with_others()
    assert not handle.busy_with_others(ours={"a"})  # told to ask again: waits on a pull
    assert _core(running=["x"])[0].busy_with_others()
    assert _core(finished=["y"])[0].busy_with_others()


def test_queued_says_whether_a_request_waits_to_be_scheduled():
    handle, st = _core(running=["x"])
    assert not handle.queued()
    handle, st = _core(waiting=[("a", None)])
    handle._core.scheduler.waiting[0].status = st.WAITING_FOR_REMOTE_KVS
    assert not handle.queued()
    handle._core.scheduler.waiting[0].status = st.WAITING
    assert handle.queued()


def test_rest_waits_on_the_input_queue_until_a_request_arrives():
    import queue
    import time

    core = types.SimpleNamespace(input_queue=queue.Queue())
    handle = vllm_glue.EngineCoreHandle(core)
    woken = threading.Event()
    threading.Timer(0.2, handle.wake).start()
    t0 = time.monotonic()
    handle.rest(woken, timeout_s=5)
    assert 0.15 < time.monotonic() - t0 < 2
    assert core.input_queue.get_nowait()[1] is None  # the no-op WAKEUP request


def test_n_children_are_told_apart_from_other_requests_by_their_parent():
    from vllm import SamplingParams
    from vllm.v1.engine.parallel_sampling import ParentRequest

    parent = ParentRequest(
        types.SimpleNamespace(
            request_id="cmpl-1-0-1a2b3c4d", external_req_id="cmpl-1-0", params=SamplingParams(n=2)
        )
    )
    ids = [parent.get_child_info(i)[0] for i in range(2)]
    assert {vllm_glue.parent_request_id(i) for i in ids} == {"cmpl-1-0-1a2b3c4d"}
    assert vllm_glue.parent_request_id("cmpl-1-0-1a2b3c4d") is None
    assert vllm_glue.parent_request_id("x_cmpl-1") is None
