"""Start and stop real servers on loopback: vLLM OpenAI servers, redis-server, etcd, http
metadata servers and mooncake_master (Mooncake Store's master, with its http metadata server).

Shared by the tests, the demo and the benchmarks. Every server runs in its own process group with
its output in a log file; ``stop()`` ends the whole group (vLLM spawns engine-core and worker
processes), and an ``atexit`` hook stops whatever is still running, so nothing outlives its owner.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.tls import Pki

_running: set[ManagedProcess] = set()
_running_lock = threading.Lock()


class ServerStartError(RuntimeError):
    """A server exited or missed its deadline while starting; the message holds its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _cpu_ticks(stat: str) -> int:
    """utime + stime (fields 14, 15) of a /proc ``stat`` line, in clock ticks."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@dataclass(eq=False)
class ManagedProcess:
    """One child process group with its log file."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child, closed below
        try:
            self.proc = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.env) if self.env is not None else None,
                cwd=self.cwd,
                start_new_session=True,  # own process group: stop() reaches every descendant
            )
        finally:
            log.close()
        with _running_lock:
            _running.add(self)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, max_bytes: int = 20_000) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[-max_bytes:].decode(errors="replace")

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll ``ready`` until it is true; fail fast if the process exits, or at the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                code = self.proc.returncode if self.proc else None
                raise ServerStartError(
                    f"{self.name} exited with code {code} before {what}; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(
            f"{self.name} not {what} within {timeout_s:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def group_pids(self) -> list[int]:
        """The live processes of this process group (vLLM: API server, engine core, workers)."""
        if self.proc is None:
            return []
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == self.proc.pid:  # field 5, pgrp
                    pids.append(int(stat.parent.name))
        return pids

    def dump_stacks(self, native: bool = True, timeout_s: float = 30.0) -> str:
        """Every live process of the group's thread stacks (``py-spy dump``, installed by
        ``make setup``): what a process that stopped making progress is waiting on."""
        py_spy = Path(sys.executable).with_name("py-spy")
        if not py_spy.exists():
            return f"(no stacks: {py_spy} is not installed)"
        out = []
        for pid in self.group_pids():
            argv = [str(py_spy), "dump", "--pid", str(pid), *(["--native"] if native else [])]
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
                out.append(f"--- pid {pid}\n{done.stdout}{done.stderr}")
            except (OSError, subprocess.TimeoutExpired) as e:
                out.append(f"--- pid {pid}: py-spy failed: {e}")
        return "\n".join(out)

    def set_autogroup_nice(self, nice: int) -> None:
        """The nice value of the process's session as a whole. With Linux's autogroup on (each
        session one scheduling group, as here) this, not a thread's nice, sets its share of the
        CPU against other sessions, such as the other servers."""
        with contextlib.suppress(OSError):  # no autogroup
            Path(f"/proc/{self.proc.pid}/autogroup").write_text(f"{nice}\n")

    def renice(self, old: int, new: int) -> None:
        """The session's autogroup, and every thread of the group still at nice ``old`` (as it
        started), go to ``new``; a thread that set its own priority since keeps it."""
        self.set_autogroup_nice(new)
        for pid in self.group_pids():
            for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
                with contextlib.suppress(OSError):  # a thread that just ended
                    tid = int(task.name)
                    if os.getpriority(os.PRIO_PROCESS, tid) == old:
                        os.setpriority(os.PRIO_PROCESS, tid, new)

    def thread_cpu_s(self) -> dict[str, float]:
        """CPU time so far per live thread of the group, keyed ``"<process>/<thread>[tid]"``
        (names from /proc ``comm``): where a process's CPU went."""
        ticks = os.sysconf("SC_CLK_TCK")
        out = {}
        for pid in self.group_pids():
            with contextlib.suppress(OSError):
                process = Path(f"/proc/{pid}/comm").read_text().strip()
                for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
                    with contextlib.suppress(OSError, IndexError, ValueError):
                        text = (task / "stat").read_text()
                        name = text.split("(", 1)[1].rsplit(")", 1)[0]
                        out[f"{process}/{name}[{task.name}]"] = _cpu_ticks(text) / ticks
        return out

    @staticmethod
    def busiest_threads(before: dict[str, float], after: dict[str, float], n: int = 5) -> str:
        """The ``n`` threads that used the most CPU between two ``thread_cpu_s`` readings."""
        used = sorted(((after[k] - before.get(k, 0.0), k) for k in after), reverse=True)[:n]
        return ", ".join(f"{k} {s:.2f}s" for s, k in used if s > 0) or "none"

    def cpu_s(self) -> float:
        """CPU time (user + system) used so far by the live processes of the group."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.group_pids():
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += _cpu_ticks(Path(f"/proc/{pid}/stat").read_text())
        return total / ticks

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``."""
        with _running_lock:
            _running.discard(self)
        if self.proc is None:
            return
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        # The leader may be gone while spawned workers linger in the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def stop_all() -> None:
    with _running_lock:
        procs = list(_running)
    for p in procs:
        p.stop(grace_s=5)


atexit.register(stop_all)


def _http_ok(url: str, timeout_s: float = 2.0, context: ssl.SSLContext | None = None) -> bool:
    with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
        return resp.status == 200


def _client_context(pki: Pki) -> ssl.SSLContext:
    """A client that trusts ``pki``'s CA and presents its client certificate."""
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return context


def http_json(url: str, body: dict | None = None, timeout_s: float = 120.0) -> dict:
    """A blocking JSON GET/POST for harness checks; raises on a non-2xx status."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def http_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def lines_named(text: str, names: Collection[str]) -> str:
    """The sample lines of a Prometheus exposition whose sample name is one of ``names``."""
    starts = tuple(f"{name}{sep}" for name in names for sep in ("{", " "))
    return "".join(line for line in text.splitlines(keepends=True) if line.startswith(starts))


def metric_samples(url: str, names: Collection[str] | None = None) -> Iterator:
    """Every sample of a Prometheus endpoint (prometheus_client's parser); with ``names``, only
    the samples of those names. vLLM's ``/metrics`` is ~90 KB and parsing all of it costs ~30 ms
    of the test's core, so the other lines are dropped before parsing."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http_text(url)
    if names is not None:
        text = lines_named(text, names)
    for family in text_string_to_metric_families(text):
        yield from family.samples


def metric_sum(url: str, name: str, **labels: str) -> float:
    """One series of a Prometheus endpoint, summed over the samples whose labels include
    ``labels``."""
    return sum(
        s.value
        for s in metric_samples(url, (name,))
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def metric_totals(url: str, names: Collection[str] | None = None) -> dict[str, float]:
    """A Prometheus endpoint's samples (those of ``names`` only, if given) summed over labels,
    by sample name."""
    out: dict[str, float] = {}
    for sample in metric_samples(url, names):
        out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


@dataclass(eq=False)
class VllmServer:
    process: ManagedProcess
    host: str
    port: int
    model: str

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _samples(self, names: Collection[str] | None = None):
        """Every sample of vLLM's ``/metrics`` (of ``names`` only, if given)."""
        return metric_samples(f"{self.url}/metrics", names)

    def metrics(self, names: Collection[str] | None = None) -> dict[str, float]:
        """vLLM's Prometheus samples (those of ``names`` only, if given) summed over labels, by
        sample name."""
        return metric_totals(f"{self.url}/metrics", names)

    def metric(self, name: str, **labels: str) -> float:
        """One Prometheus sample summed over the series whose labels include ``labels``."""
        return metric_sum(f"{self.url}/metrics", name, **labels)

    def histogram(self, name: str) -> dict[float, float]:
        """A Prometheus histogram's cumulative buckets, ``{le: count}``, summed over labels."""
        buckets: dict[float, float] = {}
        for sample in self._samples((f"{name}_bucket",)):
            if sample.name == f"{name}_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
        return buckets

    def stop(self) -> None:
        self.process.stop()


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bound of the bucket holding quantile ``q`` of the observations made between two
    ``VllmServer.histogram`` readings (nan if none)."""
    delta = sorted((le, after.get(le, 0.0) - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return float("nan")
    return next(le for le, n in delta if n >= q * total)


def histogram_count_above(
    before: dict[float, float], after: dict[float, float], bound: float
) -> float:
    """How many observations made between two ``VllmServer.histogram`` readings exceeded
    ``bound``, which must be one of the histogram's bucket bounds (nan if none was read)."""
    if not after:
        return float("nan")
    if bound not in after:
        raise ValueError(f"{bound} is not a bucket bound of this histogram ({sorted(after)})")
    total = after[max(after)] - before.get(max(after), 0.0)
    return total - (after[bound] - before.get(bound, 0.0))


def default_log_dir() -> Path:
    return Path(os.environ.get("MOONCAKE_VLLM_LOG_DIR", tempfile.gettempdir())) / "mooncake-vllm"


def vllm_env(kv_cache_gib: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    # Not the transfer engine's MC_* settings: an engine started in this process (a test, a
    # benchmark) left them in os.environ, and a server must get only the ones its spec sets.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            # 2 cores shared by several servers: no pinning, one OpenMP thread each.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    env.update(extra or {})
    return env


def engine_test_flags(max_model_len: int = 2048) -> list[str]:
    """The flags every harness engine runs with: exact float32, eager, seeded."""
    return ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
            "--seed", "0"]  # fmt: skip


def start_vllm(
    model: str | Path,
    *,
    name: str = "vllm",
    host: str = "127.0.0.1",
    port: int | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    kv_cache_gib: int = 1,
    max_model_len: int = 2048,
    log_dir: Path | None = None,
    timeout_s: float = 300.0,
    cwd: Path | None = None,
    cli: bool = False,
    nice: int = 0,
    prefix: Sequence[str] = (),
) -> VllmServer:
    """Start ``python -m vllm.entrypoints.openai.api_server`` and wait for ``/health``; with
    ``cli``, vLLM's command as the guides write it: ``vllm serve MODEL ...``.

    ``nice``: the server's session and threads start at this nice value (below 0 needs root);
    ``ManagedProcess.renice`` takes it back, once it is healthy.

    ``cwd``: ``python -m`` puts it first on ``sys.path``, so a checkout there is the one whose
    ``mooncake_vllm`` the server imports (an A/B of code, ``benchmarks.serving --ours-b-src``).
    ``vllm serve`` imports the installed one wherever it starts.

    ``prefix``: a command that execs the server, e.g. ``ip netns exec NS`` (``harness.netns``);
    ``/health`` is then polled from the calling thread's network namespace."""
    port = port or free_port(host)
    if cli:
        launch = [str(Path(sys.executable).with_name("vllm")), "serve", str(model)]
    else:
        launch = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    if nice:
        launch = ["nice", "-n", str(nice), *launch]  # nice execs it: the pid stays vLLM's
    argv = [
        *prefix,
        *launch,
        "--host", host,
        "--port", str(port),
        *engine_test_flags(max_model_len),
        *args,
    ]  # fmt: skip
    log = (log_dir or default_log_dir()) / f"{name}-{host}-{port}.log"
    proc = ManagedProcess(name, argv, log, vllm_env(kv_cache_gib, env), cwd).start()
    if nice:
        proc.set_autogroup_nice(nice)
    server = VllmServer(proc, host, port, str(model))
    proc.wait_until(lambda: _http_ok(f"{server.url}/health"), timeout_s, "healthy")
    return server


@dataclass(eq=False)
class KvServer:
    """A metadata store (etcd, redis-server or our http one) with a throwaway data dir."""

    process: ManagedProcess
    host: str
    port: int
    data_dir: Path
    kind: str  # "etcd", "redis" or "http"

    @property
    def url(self) -> str:
        """The store as ``metadata_server`` and ``proxy_server.py --discover`` take it."""
        where = f"{self.host}:{self.port}"
        return {"etcd": f"etcd://{where}", "redis": f"redis://{where}"}.get(
            self.kind, f"http://{where}/metadata"
        )

    def stop(self) -> None:
        self.process.stop()


def _port_open(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=1):
        return True


def start_redis(
    host: str = "127.0.0.1",
    port: int | None = None,
    log_dir: Path | None = None,
    *,
    tls: Pki | None = None,
    extra_args: Sequence[str] = (),
    prefix: Sequence[str] = (),
):
    """redis-server on loopback. With ``tls`` (``harness.tls.make_pki``) it speaks only TLS on
    ``port``, with ``tls``'s server certificate, and requires a client certificate of its CA.
    ``extra_args`` are more redis-server options (e.g. ``--requirepass``, test passwords only).
    ``prefix``: a command that execs it (``ip netns exec NS``, as for ``start_vllm``); ``port``
    is then required (a free port here says nothing of another namespace)."""
    port = port or free_port(host)
    data_dir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-redis-"))
    argv = [
        "redis-server", "--bind", host, "--port", "0" if tls else str(port),
        "--dir", str(data_dir), "--save", "", "--appendonly", "no", "--protected-mode", "no",
    ]  # fmt: skip
    if tls is not None:
        argv += [
            "--tls-port", str(port), "--tls-cert-file", str(tls.server_cert),
            "--tls-key-file", str(tls.server_key), "--tls-ca-cert-file", str(tls.ca_cert),
            "--tls-auth-clients", "yes",
        ]  # fmt: skip
    argv = [*prefix, *argv, *extra_args]
    log = (log_dir or default_log_dir()) / f"redis-{host}-{port}.log"
    proc = ManagedProcess("redis-server", argv, log).start()
    proc.wait_until(lambda: _port_open(host, port), 30, "accepting connections")
    return KvServer(proc, host, port, data_dir, "redis")


def start_etcd(
    host: str = "127.0.0.1",
    port: int | None = None,
    log_dir: Path | None = None,
    data_dir: Path | None = None,
    *,
    tls: Pki | None = None,
    extra_args: Sequence[str] = (),
    prefix: Sequence[str] = (),
):
    """etcd on loopback; pass a stopped server's ``data_dir`` to restart it with its data.
    ``prefix``: a command that execs it (``ip netns exec NS``, as for ``start_vllm``).

    With ``tls`` (``harness.tls.make_pki``) clients reach it by https with ``tls``'s server
    certificate and must present a client certificate of its CA (``--client-cert-auth``).
    ``extra_args`` are more etcd options (e.g. ``--auth-token-ttl``)."""
    port = port or free_port(host)
    peer_port = port + 1 if prefix else free_port(host)  # another namespace: not bindable here
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="mooncake-vllm-etcd-"))
    scheme = "https" if tls else "http"
    client_url, peer_url = f"{scheme}://{host}:{port}", f"http://{host}:{peer_port}"
    argv = [
        "etcd", "--name", "test", "--data-dir", str(data_dir),
        "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"test={peer_url}",
    ]  # fmt: skip
    if tls is not None:
        argv += [
            "--cert-file", str(tls.server_cert), "--key-file", str(tls.server_key),
            "--trusted-ca-file", str(tls.ca_cert), "--client-cert-auth",
        ]  # fmt: skip
    argv = [*prefix, *argv, *extra_args]
    log = (log_dir or default_log_dir()) / f"etcd-{host}-{port}.log"
    proc = ManagedProcess("etcd", argv, log).start()
    context = _client_context(tls) if tls is not None else None
    proc.wait_until(lambda: _http_ok(f"{client_url}/health", context=context), 30, "healthy")
    return KvServer(proc, host, port, data_dir, "etcd")


def start_http_metadata(
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    mooncakes: bool = False,
    data_dir: Path | None = None,
    log_dir: Path | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    prefix: Sequence[str] = (),
):
    """Our http metadata server (``mooncake_vllm.transfer.http_store``, persisting to ``data_dir``),
    or with ``mooncakes=True`` the one Mooncake ships (``mooncake.http_metadata_server``).
    ``extra_args`` are more options (e.g. ``--token-file``), ``env`` its environment, ``prefix``
    a command that execs it (as for ``start_redis``)."""
    port = port or free_port(host)
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="mooncake-vllm-http-metadata-"))
    if mooncakes:
        argv = [sys.executable, "-m", "mooncake.http_metadata_server", "--host", host]
    else:
        argv = [sys.executable, "-m", "mooncake_vllm.transfer.http_store", "--host", host]
        argv += ["--persist", str(data_dir / "metadata.json")]
    argv = [*prefix, *argv, "--port", str(port), *extra_args]
    name = "mooncake-http-metadata" if mooncakes else "http-metadata"
    log = (log_dir or default_log_dir()) / f"{name}-{host}-{port}.log"
    proc = ManagedProcess(name, argv, log, env=env).start()
    proc.wait_until(lambda: _port_open(host, port), 30, "accepting connections")
    return KvServer(proc, host, port, data_dir, "http")


@dataclass(eq=False)
class MasterServer:
    """mooncake_master on loopback, serving the pool's RPC and its built-in http metadata."""

    process: ManagedProcess
    host: str
    port: int
    metadata_port: int
    metrics_port: int

    @property
    def address(self) -> str:
        """``master_server_address`` for the pool's config."""
        return f"{self.host}:{self.port}"

    @property
    def metadata_url(self) -> str:
        """``metadata_server`` for the pool's config."""
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def stop(self) -> None:
        self.process.stop()


def start_mooncake_master(
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    metadata_port: int | None = None,
    log_dir: Path | None = None,
    extra_args: Sequence[str] = (),
) -> MasterServer:
    """``mooncake_master`` (the console command of the transfer-engine wheel) with
    ``--enable_http_metadata_server``. Pass a stopped master's ports to restart it in place.

    The wheel (0.3.13.post1) binds its http metadata server to every interface whatever
    ``--http_metadata_server_host`` says, so its port is picked free on all of them.

    ``--client_ttl 30``: the default 10 s equals the read lease, so one stall of a holder's
    store threads (docs/pool.md, Threads) both expires a read and drops every object of that
    holder (the retry then finds nothing: -704); 30 s outlasts the stalls measured here."""
    port = port or free_port(host)
    metadata_port = metadata_port or free_port("0.0.0.0")
    metrics_port = free_port(host)
    command = Path(sys.executable).with_name("mooncake_master")
    argv = [
        str(command) if command.exists() else "mooncake_master",
        "--rpc_address", host, "--rpc_port", str(port),
        "--enable_http_metadata_server",
        "--http_metadata_server_host", host, "--http_metadata_server_port", str(metadata_port),
        "--metrics_host", host, "--metrics_port", str(metrics_port),
        "--client_ttl", "30",
        *extra_args,
    ]  # fmt: skip
    log = (log_dir or default_log_dir()) / f"mooncake-master-{host}-{port}.log"
    proc = ManagedProcess("mooncake_master", argv, log).start()
    proc.wait_until(
        lambda: _port_open(host, port) and _port_open(host, metadata_port), 30, "listening"
    )
    return MasterServer(proc, host, port, metadata_port, metrics_port)


@contextlib.contextmanager
def running(server) -> Iterator:
    """``with running(start_redis()) as r:`` stops the server however the block ends."""
    try:
        yield server
    finally:
        server.stop()
