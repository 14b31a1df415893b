"""The demo: a real prefill/decode pair on CPU, the transfer engine over TCP, the proxy, requests.

    python -m harness.demo            (what ``make demo`` runs)

Builds the tiny local model if needed, starts prefill (127.0.0.2) and decode (127.0.0.3) vLLM
servers with MooncakeConnector, starts the proxy, sends a few requests (one streamed), prints the
answers and the transfer figures read from the servers' own /metrics, and stops everything, also
on Ctrl-C. The model has random weights: its text is noise, the point is where the KV came from.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from tqdm import tqdm

from harness import placement, servers
from harness.pd import (
    DECODE_HOST,
    PREFILL_HOST,
    ServerSpec,
    client_session,
    kv_args,
    mooncake_json,
)
from harness.pd import start_many as _start_many
from harness.tiny_model import build_tiny_model

# Log lines that mark how far a vLLM server has come, in order.
STAGES = [
    ("non-default args", "parsing arguments"),
    ("Initializing a V1 LLM engine", "engine process up"),
    ("Starting to load model", "loading the model"),
    ("KV cache size", "allocating the KV cache"),
    ("MooncakeConnector worker", "transfer engine registered"),
    ("Starting vLLM server", "serving"),
]

PROMPTS = [
    "Prefill computes the prompt once; decode pulls its KV cache and goes on generating. " * 6,
    "Mooncake's transfer engine moves KV blocks between machines over TCP or RDMA. " * 12,
]


def say(msg: str) -> None:
    tqdm.write(f"\033[1mdemo:\033[0m {msg}")


def watch_start(logs: dict[str, Path], done: threading.Event) -> None:
    """Show how far each server has come, from the stage its log has reached: a progress bar
    per server on a terminal, a line per stage change (and a heartbeat) otherwise."""
    tty = sys.stderr.isatty()
    bars = {
        name: tqdm(total=len(STAGES), desc=f"{name:>7}", position=i, leave=True,
                   bar_format="{desc}: {n}/{total} |{bar:20}| {elapsed} {postfix}")
        for i, name in enumerate(logs)
    } if tty else {}  # fmt: skip
    reached_n = dict.fromkeys(logs, 0)
    started, beat = time.monotonic(), time.monotonic()
    while True:
        for name, path in logs.items():
            text = path.read_text(errors="replace") if path.exists() else ""
            reached = [label for marker, label in STAGES if marker in text]
            if len(reached) > reached_n[name]:
                reached_n[name] = len(reached)
                if tty:
                    bars[name].update(len(reached) - bars[name].n)
                    bars[name].set_postfix_str(reached[-1])
                else:
                    say(f"{name}: {reached[-1]} ({time.monotonic() - started:.0f} s)")
        for bar in bars.values():
            bar.refresh()
        if not tty and time.monotonic() - beat > 30:
            beat = time.monotonic()
            say(f"still starting ({beat - started:.0f} s)")
        if done.wait(1.0):
            break
    for bar in bars.values():
        bar.close()


def start_servers(model: str, workdir: Path, log_dir: Path):
    cfg = mooncake_json(workdir / "mooncake.json")
    say(f"mooncake.json ({cfg}):\n{cfg.read_text()}")
    # Each engine on its own cores (harness.placement): left to vLLM's default, both would bind
    # every core of the host and fight over them.
    cores = placement.split_cores(2)
    envs = [{"MOONCAKE_CONFIG_PATH": str(cfg), **placement.bind_env(c)} for c in cores]
    specs = [
        ServerSpec("prefill", PREFILL_HOST, kv_args("kv_producer"), envs[0], cli=True),
        ServerSpec(
            "decode", DECODE_HOST, kv_args("kv_consumer", kv_load_failure_policy="recompute"),
            envs[1], cli=True,
        ),
    ]  # fmt: skip
    for s in specs:
        env = " ".join(f"{k}={v}" for k, v in s.env.items())
        say(f"{s.name}: {env} vllm serve {model} --host {s.host} "
            f"{' '.join(map(_quote, s.args))}")  # fmt: skip
    say("starting prefill and decode (vLLM takes a few minutes to start on 2 cores)")
    done = threading.Event()
    before = set(log_dir.glob("*.log")) if log_dir.exists() else set()
    found: dict[str, Path] = {}

    def logs() -> dict[str, Path]:
        for p in sorted(log_dir.glob("*.log")):
            if p not in before:
                for s in specs:
                    if p.name.startswith(f"{s.name}-{s.host}-"):
                        found[s.name] = p
        return found

    watcher = threading.Thread(target=_watch_when_logs_exist, args=(logs, specs, done), daemon=True)
    watcher.start()
    try:
        return _start_many(model, specs, log_dir=log_dir)
    finally:
        done.set()
        watcher.join()


def _watch_when_logs_exist(logs, specs, done: threading.Event) -> None:
    while len(logs()) < len(specs) and not done.wait(0.2):
        pass
    watch_start(logs(), done)


def _quote(arg: str) -> str:
    return f"'{arg}'" if arg.startswith("{") else arg


async def send_requests(proxy_url: str, model: str) -> None:
    async with client_session() as http:
        for i, prompt in enumerate(PROMPTS, 1):
            body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
            t0 = time.perf_counter()
            async with http.post(f"{proxy_url}/v1/completions", json=body) as resp:
                data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"request {i}: HTTP {resp.status}: {data}")
            ms = (time.perf_counter() - t0) * 1000
            text, n = data["choices"][0]["text"], data["usage"]["prompt_tokens"]
            say(f"request {i} ({n} prompt tokens, {ms:.0f} ms): {text!r}")
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
        }
        say("request 3 (chat, streamed):")
        async with http.post(f"{proxy_url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"streamed request: HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    for choice in json.loads(line[5:]).get("choices", []):
                        sys.stdout.write(choice.get("delta", {}).get("content") or "")
                        sys.stdout.flush()
        print()


def report(prefill: servers.VllmServer, decode: servers.VllmServer) -> None:
    d, p = decode.metric, prefill.metric
    pulls, nbytes = d("mooncake_vllm:pulls_total"), d("mooncake_vllm:bytes_total")
    secs = d("mooncake_vllm:pull_duration_seconds_sum")
    by_source = {
        s: d("vllm:prompt_tokens_by_source_total", source=s)
        for s in ("external_kv_transfer", "local_cache_hit", "local_compute")
    }
    lines = [
        "transfer figures (from the servers' own /metrics):",
        f"  decode pulled   {pulls:.0f} prompts, {d('mooncake_vllm:blocks_total'):.0f} blocks, "
        f"{nbytes / 1e6:.1f} MB in {secs * 1000:.1f} ms "
        f"({nbytes / secs / 1e9 if secs else 0:.2f} GB/s, "
        f"{secs * 1000 / pulls if pulls else 0:.1f} ms per pull), "
        f"{d('mooncake_vllm:pull_failures_total'):.0f} failed",
        "  decode's prompt tokens: " + ", ".join(f"{k} {v:.0f}" for k, v in by_source.items()),
        f"  prefill released {p('mooncake_vllm:released_total'):.0f} leases after the pulls; "
        f"held now: {p('mooncake_vllm:held_leases'):.0f}",
    ]
    say("\n".join(lines))
    if pulls == 0 or by_source["external_kv_transfer"] == 0:
        raise RuntimeError("decode loaded no KV by transfer: see the server logs")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proxy-port", type=int, default=None, help="(default: a free port)")
    ap.add_argument("--keep-running", action="store_true", help="serve until Ctrl-C")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t0 = time.monotonic()
    started: list = []
    try:
        say("building (or reusing) the tiny local model")
        model = str(build_tiny_model())
        workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-demo-"))
        log_dir = workdir / "logs"
        prefill, decode = start_servers(model, workdir, log_dir)
        started += [prefill, decode]
        say(f"prefill {prefill.url}, decode {decode.url} up after {time.monotonic() - t0:.0f} s")
        proxy_port = args.proxy_port or servers.free_port()
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        proxy = servers.ManagedProcess(
            "proxy",
            [sys.executable, "-m", "mooncake_vllm.proxy.server", "--prefill", prefill.url,
             "--decode", decode.url, "--port", str(proxy_port)],
            log_dir / "proxy.log",
        ).start()  # fmt: skip
        started.append(proxy)
        proxy.wait_until(lambda: servers.http_text(f"{proxy_url}/health") != "", 60, "healthy")
        say(f"proxy {proxy_url} (python -m mooncake_vllm.proxy.server --prefill {prefill.url} "
            f"--decode {decode.url})")  # fmt: skip
        asyncio.run(send_requests(proxy_url, model))
        time.sleep(1.5)  # let the servers publish their last step's stats
        report(prefill, decode)
        say(f"logs in {log_dir}; total {time.monotonic() - t0:.0f} s")
        if args.keep_running:
            say(f"serving at {proxy_url}; Ctrl-C stops everything")
            threading.Event().wait()
        return 0
    except KeyboardInterrupt:
        say("interrupted: stopping")
        return 130
    except Exception as e:
        say(f"failed: {e}")
        return 1
    finally:
        for s in reversed(started):
            s.stop()
        servers.stop_all()
        say("all servers stopped")


if __name__ == "__main__":
    sys.exit(main())
