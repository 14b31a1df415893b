"""vLLM's Rust router (``pip install vllm-router``, vllm-project/router) as a real process.

``make test-router`` installs it in its own venv (``scripts/setup_tool.sh``) and names the
binary in ``MOONCAKE_VLLM_ROUTER``; ``router_binary()`` is None where it is not installed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.servers import ManagedProcess, _http_ok, default_log_dir, free_port

ROUTER_ENV = "MOONCAKE_VLLM_ROUTER"


def router_binary() -> str | None:
    """The ``vllm-router`` executable ``MOONCAKE_VLLM_ROUTER`` names, if it exists."""
    path = os.environ.get(ROUTER_ENV)
    return shutil.which(path) if path else None


@dataclass(eq=False)
class RouterServer:
    process: ManagedProcess
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.process.stop(grace_s=10)


def pd_args(
    prefills: Sequence[tuple[str, int | None]], decodes: Sequence[str], connector: str
) -> list[str]:
    """``--vllm-pd-disaggregation --kv-connector C --prefill URL [PORT]... --decode URL...``:
    each prefill with its bootstrap port (None: ``none``, which the nixl mode takes)."""
    args = ["--vllm-pd-disaggregation", "--kv-connector", connector]
    for url, port in prefills:
        args += ["--prefill", url, str(port) if port else "none"]
    for url in decodes:
        args += ["--decode", url]
    return args


def start_router(
    args: Sequence[str],
    *,
    name: str = "router",
    host: str = "127.0.0.1",
    log_dir: Path | None = None,
    timeout_s: float = 60.0,
) -> RouterServer:
    """``vllm-router ARGS --host H --port P --prometheus-port Q`` (a port of its own: the
    default 29000 would clash between routers), up when ``/health`` answers 200 (every worker
    it was given has answered its own ``/health``)."""
    binary = router_binary()
    if binary is None:
        raise RuntimeError(f"no vllm-router: set {ROUTER_ENV} (make test-router does)")
    port, prom = free_port(host), free_port(host)
    argv = [binary, *args, "--host", host, "--port", str(port)]
    argv += ["--prometheus-host", host, "--prometheus-port", str(prom)]
    log = (log_dir or default_log_dir()) / f"{name}-{host}-{port}.log"
    proc = ManagedProcess(name, argv, log, dict(os.environ)).start()
    server = RouterServer(proc, host, port)
    proc.wait_until(lambda: _http_ok(f"{server.url}/health"), timeout_s, "answering /health")
    return server
