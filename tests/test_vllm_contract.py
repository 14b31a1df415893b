"""The contract with vLLM, pinned without a server: the signatures of every ``KVConnectorBase_V1``
hook our connectors override, and the internals ``vllm_glue`` probes. A vLLM upgrade that changes
any of them fails here, in CI, not in a user's cluster.

The same checks run on the sources of each release in ``RELEASES`` (read as files from its
wheel, ``harness.vllm_release``: vLLM's CUDA wheels do not install on a CPU host). A release
joins ``vllm_glue.TESTED`` and the ``cuda`` extra's range only while they pass; without the wheel
(no package index) they are skipped, saying so."""

from __future__ import annotations

import ast
import inspect
import signal
import sys
import threading
import types
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from harness.vllm_release import ReleaseUnavailable, release_files
from mooncake_vllm import vllm_glue
from mooncake_vllm.connector import MooncakeConnector
from mooncake_vllm.pool.connector import MooncakeStoreConnector

# Releases besides the installed one whose sources the contract is checked against.
RELEASES = ("0.33.0",)
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

# Hook → its parameters in the tested vLLMs (0.32, 0.33). Ours must take the same.
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
    "set_xfer_handshake_metadata_pp_aware": ["self", "metadata"],
    "shutdown": ["self"],
    "start_load_kv": ["self", "forward_context", "kwargs"],
    "update_connector_output": ["self", "connector_output"],
    "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    "wait_for_layer_load": ["self", "layer_name"],
    "wait_for_save": ["self"],
    # vLLM 0.33, sleep mode: ours refuse it (core/sleep_mode.py).
    "supports_sleep_mode": ["kv_transfer_config"],
    "unregister_kv_caches": ["self"],
    "restore_kv_caches": ["self"],
}

# The base class's other public methods: their defaults suit both connectors, each for the
# reason given. A release that adds a method fails ``test_every_base_method_is_reviewed`` until
# it is pinned above or given its reason here.
INHERITED = {
    "bind_connector_metadata": "vLLM's plumbing of the step metadata",
    "clear_connector_metadata": "vLLM's plumbing of the step metadata",
    "has_connector_metadata": "vLLM's plumbing of the step metadata",
    "role": "property",
    "bind_kv_cache_manager": "no use for the manager",
    "finish_forward": "nothing to do after a forward",
    "get_block_ids_with_load_errors": "failed loads are reported whole, in failed_recving",
    "get_external_cache_hit_sources": "the default source (P2P / external) is right",
    "get_finished_count": "every worker reports (None: vLLM counts the TP ranks)",
    "get_kv_connector_kv_cache_events": "no KV cache events",
    "take_events": "no KV cache events",
    "get_loaded_kv_cache_group_ids": "all groups are loaded",
    "get_mem_pool_context": "vLLM's allocator: the registered KV cache is a plain tensor",
    "get_required_kvcache_layout": "vLLM's layout; the planner reads any from the tensors",
    # For connectors that save asynchronously (vLLM's OffloadingConnector): the pool's saves end
    # in wait_for_save, within the step; a P2P lease pins a finished request's blocks; a load
    # keeps its pinned blocks until it settles.
    "handle_preemptions": "no save outlives its step: nothing to do before blocks are reused",
    "has_pending_block_frees": "blocks are freed through get_finished",
    "on_new_request": "nothing per new request",
    "register_finished_partial_tail": "no partial-block saving",
    "requires_kv_delivery": "P2P keeps the default (the producer role); the pool: False",
    # Only ``layerwise_handoff`` works in save_kv_layer, and it is refused off the CPU backend
    # (``check_layerwise``), where no CUDA graph replays.
    "requires_piecewise_for_cudagraph": "the default (False): no per-layer work on a GPU",
    "reset_cache": "prefix cache reset needs nothing from us",
    "reset_capture_state": "no CUDA-graph capture state",
    "set_host_xfer_buffer_ops": "no host staging buffer through vLLM",
    # A hybrid model's recurrent (Mamba) state is refused at startup (core.kv_groups): there is
    # no lagging state of ours to restore, so vLLM must not count on an external hit for it.
    "supports_divergent_local_hybrid_hits": "the default (False): no recurrent state moved",
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


@pytest.fixture(scope="module", params=("installed", *RELEASES))
def vllm_files(request) -> vllm_glue.VllmFiles:
    """The installed vLLM's sources, then each release's, read as files."""
    if request.param == "installed":
        return vllm_glue.VllmFiles.installed()
    try:
        return release_files(request.param)
    except ReleaseUnavailable as e:
        pytest.skip(f"vLLM {request.param} not checked, its wheel cannot be had here: {e}")


def _base_methods(files: vllm_glue.VllmFiles) -> dict[str, ast.FunctionDef]:
    cls = files.node(BASE, "KVConnectorBase_V1")
    return {
        n.name: n
        for n in getattr(cls, "body", [])
        if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
    }


def test_every_internal_probes_and_the_version_is_tested(vllm_files):
    found = vllm_glue.probe_files(vllm_files)
    assert found.failures == {}, f"vLLM {found.version}"
    assert vllm_glue.is_tested(found.version), found.version


def test_the_hooks_we_override_take_the_same_parameters_there(vllm_files):
    methods = _base_methods(vllm_files)
    for cls in (MooncakeConnector, MooncakeStoreConnector):
        for name in _overridden(cls):
            assert name in methods, f"vLLM {vllm_files.version} has no {name}"
            there = vllm_files.params(BASE, f"KVConnectorBase_V1.{name}")
            assert there == HOOKS[name], f"vLLM {vllm_files.version} changed {name}: {there}"


def test_every_base_method_is_reviewed(vllm_files):
    methods = set(_base_methods(vllm_files))
    unknown = methods - set(HOOKS) - set(INHERITED)
    assert not unknown, f"vLLM {vllm_files.version} adds {sorted(unknown)}: pin or review them"


def test_every_abstract_hook_is_ours(vllm_files):
    abstract = [
        name
        for name, fn in _base_methods(vllm_files).items()
        if any("abstractmethod" in ast.unparse(d) for d in fn.decorator_list)
    ]
    assert abstract
    for cls in (MooncakeConnector, MooncakeStoreConnector):
        missing = [n for n in abstract if n not in _overridden(cls)]
        assert not missing, f"{cls.__name__} lacks {missing} (vLLM {vllm_files.version})"


def _our_vllm_imports() -> set[tuple[str, str]]:
    package = Path(vllm_glue.__file__).parent
    found = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        optional = {  # imports guarded by ``except ImportError``: newer vLLMs only
            id(n)
            for t in ast.walk(tree)
            if isinstance(t, ast.Try)
            and any("ImportError" in ast.unparse(h.type or ast.Name("")) for h in t.handlers)
            for stmt in t.body
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                found |= {(node.module, a.name) for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {(a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"}
    return found


def test_everything_we_import_from_vllm_is_there(vllm_files):
    imports = _our_vllm_imports()
    assert len(imports) > 20  # the walk found them
    missing = [
        f"{module}.{name}" if name else module
        for module, name in sorted(imports)
        if not (vllm_files.defines(module, name) if name else vllm_files.exists(module))
    ]
    assert not missing, f"vLLM {vllm_files.version} lacks {missing}"


def test_a_moved_internal_fails_its_probe_by_name(tmp_path):
    """A tree where each internal is missing: every probe says what it did not find."""
    for module in ("vllm/v1/engine/__init__.py", "vllm/v1/request.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "vllm/__init__.py").write_text("")
    (tmp_path / "vllm/v1/engine/__init__.py").write_text(
        "class EngineCoreRequestType:\n    ADD = b'\\x00'\n"
    )
    (tmp_path / "vllm/v1/request.py").write_text("class RequestStatus:\n    WAITING = 1\n")
    (tmp_path / "vllm/utils").mkdir()
    (tmp_path / "vllm/utils/watch_dog.py").write_text("class WatchDog:\n    pass\n")
    found = vllm_glue.probe_files(vllm_glue.VllmFiles(tmp_path, "9.9.9"))
    assert found.failures["wakeup"] == "no WAKEUP request type"
    assert found.failures["request_status"] == "no WAITING_FOR_REMOTE_KVS"
    assert found.failures["watchdog"] == "vllm.utils.watch_dog has no get_watch_dog"
    for name in ("engine_core", "scheduler_queues", "queue_spin", "connector_registry"):
        assert "ModuleNotFoundError" in found.failures[name], name
    assert set(found.failures) >= {"block_pool", "cpu_kv_format"}


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


def test_a_load_vllm_deferred_keeps_the_engine_stepping():
    handle, _ = _core()
    handle._core.scheduler.deferred_loads = {"a": (3, 16, 0, 0)}  # vLLM 0.33, HiSparse
    assert handle.busy_with_others()
    handle._core.scheduler.deferred_loads = {}
    assert not handle.busy_with_others()


def test_a_rest_pauses_vllms_watchdog(monkeypatch):
    """vLLM 0.33 pauses its engine-core watchdog while it blocks on the input queue; a rest is
    that wait taken inside a step, so it pauses it too (and leaves a paused one alone)."""
    import contextlib
    import queue

    seen = []

    class Dog:
        active = True

        @contextlib.contextmanager
        def disable(self):
            assert self.active, "not re-entrant"
            self.active = False
            seen.append("paused")
            yield
            self.active = True

    dog = Dog()
    fake = types.ModuleType("vllm.utils.watch_dog")
    fake.get_watch_dog = lambda: dog
    monkeypatch.setitem(sys.modules, "vllm.utils.watch_dog", fake)
    monkeypatch.setattr(vllm_glue, "_checked", None)
    handle = vllm_glue.EngineCoreHandle(types.SimpleNamespace(input_queue=queue.Queue()))
    woken = threading.Event()
    woken.set()
    handle.rest(woken, timeout_s=1)
    assert seen == ["paused"] and dog.active
    with dog.disable():
        handle.rest(woken, timeout_s=1)  # already paused: not paused again
    assert seen == ["paused", "paused"]


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


def test_the_cuda_extras_admit_exactly_the_tested_vllms():
    """``pip install .[cuda]`` gets a vLLM that ``check_vllm`` accepts, and no newer one."""
    import tomllib
    from packaging.requirements import Requirement

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    for extra in ("cuda", "cuda12"):
        (vllm,) = [Requirement(r) for r in extras[extra] if Requirement(r).name == "vllm"]
        for minor in range(20, 40):
            version = f"0.{minor}.0"
            admitted = vllm.specifier.contains(version)
            assert admitted == vllm_glue.is_tested(version), (extra, version)


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


def test_one_api_requests_prompts_and_children_are_one_family():
    family = vllm_glue.request_family
    # a prompt list's items (repeated prompts share one handoff) and their n > 1 children
    ids = ["cmpl-ab12-0-1a2b3c4d", "cmpl-ab12-2-9f8e7d6c", "1_cmpl-ab12-0-1a2b3c4d"]
    assert {family(i) for i in ids} == {"cmpl-ab12"}
    assert family("cmpl-cd34-0-1a2b3c4d") != family("cmpl-ab12-0-1a2b3c4d")
    assert family("chatcmpl-x-1a2b3c4d") == "chatcmpl-x"


_WORKER_SCRIPT = """
import os, signal, sys, threading, time
from mooncake_vllm import vllm_glue

# vLLM's thread waiting on the death pipe: while it runs, the engine core serves.
pipe_open = threading.Event()
threading.Thread(target=pipe_open.wait, name="DeathPipeMonitor", daemon=True).start()

class WorkerProc:  # named as vLLM's, so its handler's qualified name is vLLM's
    @staticmethod
    def worker_main():
        def signal_handler(signum, frame):
            raise SystemExit(7)

        signal.signal(signal.SIGTERM, signal_handler)
        signal.signal(signal.SIGINT, signal_handler)
        print(vllm_glue.outlive_group_signal(), flush=True)
        vllm_glue.arm_group_signal_hold()  # the engine core started: it asked for handshakes
        os.kill(os.getpid(), signal.SIG%s)  # the group's signal: logged, ignored
        time.sleep(0.2)
        print("alive", flush=True)
        pipe_open.set()  # the engine core closed the death pipe
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)  # the executor's, after its grace: vLLM's handler
        time.sleep(5)
        print("not stopped", flush=True)

WorkerProc.worker_main()
"""


@pytest.mark.parametrize("first", ["TERM", "INT"])
def test_a_workers_first_signal_is_outlived_and_the_second_is_vllms(first):
    """vLLM's mp worker exits on the first SIGTERM/SIGINT; a producer's worker wrapped by
    ``outlive_group_signal`` keeps serving through a group signal and exits on the next."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _WORKER_SCRIPT % first],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["True", "alive"], done.stdout + done.stderr
    assert done.returncode == 7, done.stderr
    assert "keeps serving while the engine core drains" in done.stderr


def test_a_workers_signal_once_the_engine_core_ends_it_is_vllms():
    """No group signal before: the executor's SIGTERM after its grace (the death pipe closed)
    exits the worker through vLLM's handler at once, as without the wrapper."""
    import subprocess

    script = _WORKER_SCRIPT.replace('print("alive", flush=True)', "")
    script = script.replace(
        "os.kill(os.getpid(), signal.SIG%s)", "pipe_open.set(); time.sleep(0.2)"
    )
    script = script.replace("signal.SIG%s", "signal.SIGTERM")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["True"], done.stdout + done.stderr
    assert done.returncode == 7, done.stderr
    assert "keeps serving" not in done.stderr


def test_a_workers_signal_before_the_engine_core_started_is_vllms():
    """An engine core that fails to start (our scheduler half refused its config, after the
    workers started) terminates its workers and joins them: the first SIGTERM exits the worker
    through vLLM's handler, or both would wait for ever."""
    import subprocess

    script = _WORKER_SCRIPT.replace("        vllm_glue.arm_group_signal_hold()", "        pass")
    done = subprocess.run(
        [sys.executable, "-c", script % "TERM"], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["True"], done.stdout + done.stderr
    assert done.returncode == 7, done.stderr
    assert "keeps serving" not in done.stderr


def test_outside_a_vllm_worker_the_signal_handlers_are_left_alone():
    before = signal.getsignal(signal.SIGTERM)
    assert vllm_glue.outlive_group_signal() is False
    assert signal.getsignal(signal.SIGTERM) is before


_ENGINE_CORE_SCRIPT = """
import os, signal, sys, threading, time
from mooncake_vllm import vllm_glue

class EngineCoreProc:  # named as vLLM's, so its handler's qualified name is vLLM's
    @staticmethod
    def run_engine_core():
        event_lock = threading.Lock()  # what Event.set holds (SignalCallback.trigger)
        calls = []

        def signal_handler(signum, frame):
            calls.append(signal.Signals(signum).name)
            if len(calls) == 1:
                with event_lock:
                    os.kill(os.getpid(), signal.SIGTERM)  # the API server's, handled in here
                    for _ in range(10_000):
                        pass
            elif not event_lock.acquire(timeout=1):
                calls.append("deadlocked")
            else:
                event_lock.release()

        signal.signal(signal.SIGTERM, signal_handler)
        signal.signal(signal.SIGINT, signal_handler)
        print(%s, flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # the group's (Ctrl-C)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)  # a later one: handled as vLLM does
        time.sleep(0.2)
        print(" ".join(calls), flush=True)

EngineCoreProc.run_engine_core()
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_signal_inside_the_engine_cores_handler_does_not_run_it_again(guarded):
    """vLLM's engine-core handler, re-entered by a second signal while it holds its event's
    lock, waits on that lock for ever; wrapped, the nested signal returns at once and a later
    one runs vLLM's handler as before. Unwrapped (the check that the script can fail), the
    nested call finds the lock held."""
    import subprocess

    call = "vllm_glue.one_engine_core_signal_at_a_time()" if guarded else "False"
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE_CORE_SCRIPT % call],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    if guarded:
        assert lines == ["True", "SIGINT SIGTERM"], done.stdout + done.stderr
    else:
        assert lines == ["False", "SIGINT SIGTERM deadlocked SIGTERM"], done.stdout + done.stderr


def test_outside_vllms_engine_core_its_signal_handlers_are_left_alone():
    before = signal.getsignal(signal.SIGTERM)
    assert vllm_glue.one_engine_core_signal_at_a_time() is False
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_hybrid_allocator_hook_takes_the_same_parameters_there(vllm_files):
    """``SupportsHMA`` keeps vLLM's hybrid memory allocator on for both connectors (a
    sliding-window model then gets a KV cache group per kind, ``core.kv_groups``); vLLM calls
    ``request_finished_all_groups`` instead of ``request_finished``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    there = vllm_files.params(BASE, "SupportsHMA.request_finished_all_groups")
    assert there == ["self", "request", "block_ids"], f"vLLM {vllm_files.version}: {there}"
    for cls in (MooncakeConnector, MooncakeStoreConnector):
        assert issubclass(cls, SupportsHMA), cls.__name__
        assert _params(cls.request_finished_all_groups) == there, cls.__name__


def test_neither_release_has_eagle_aware_block_hashes_yet(vllm_files):
    """vLLM's ``Request.num_publishable_block_hashes`` (EAGLE-aware prefix hashing, in review)
    would tell which of a request's blocks a connector may publish while a draft model's KV lags
    behind. Neither 0.32 nor 0.33 has it, so the pool keys and saves every computed prompt block
    (``pool.keys``). The day a release adds it this fails: use it there."""
    source = vllm_files.path("vllm.v1.request").read_text()
    assert "num_publishable_block_hashes" not in source, f"vLLM {vllm_files.version}"
