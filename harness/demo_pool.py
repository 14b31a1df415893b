"""The pool demo: mooncake_master, a prefill and a decode vLLM with MooncakeStoreConnector, and the
proxy in pool mode (the minimal proxy of Mooncake's vLLM guide: prefill with max_tokens=1, then
the original request to decode, nothing handed over).

    python -m harness.demo_pool       (what ``make demo-pool`` runs)

Prints the answers and where the decode's prompt tokens came from (its own /metrics), and stops
everything, also on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from harness import servers
from harness.demo import say, send_requests
from harness.pd import ServerSpec, start_many
from harness.tiny_model import build_tiny_model


def report(prefill: servers.VllmServer, decode: servers.VllmServer) -> None:
    def pool(srv, key):
        return srv.metric(f"mooncake_vllm:pool_{key}_total")

    by_source = {
        s: decode.metric("vllm:prompt_tokens_by_source_total", source=s)
        for s in ("external_kv_transfer", "local_cache_hit", "local_compute")
    }
    say(
        "pool figures (from the servers' own /metrics):\n"
        f"  prefill put {pool(prefill, 'put_blocks'):.0f} blocks "
        f"({pool(prefill, 'put_bytes') / 1e6:.1f} MB), skipped "
        f"{pool(prefill, 'put_skipped_blocks'):.0f} already there, "
        f"{pool(prefill, 'put_failures'):.0f} failed\n"
        f"  decode found {pool(decode, 'hit_blocks'):.0f} blocks in the pool, missed "
        f"{pool(decode, 'miss_blocks'):.0f}; got {pool(decode, 'get_blocks'):.0f} blocks, "
        f"{pool(decode, 'load_failures'):.0f} loads failed\n"
        "  decode's prompt tokens: " + ", ".join(f"{k} {v:.0f}" for k, v in by_source.items())
    )
    if by_source["external_kv_transfer"] == 0:
        raise RuntimeError("decode loaded nothing from the pool: see the server logs")


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t0 = time.monotonic()
    started: list = []
    try:
        model = str(build_tiny_model())
        log_dir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-demo-pool-")) / "logs"
        master = servers.start_mooncake_master(log_dir=log_dir)
        started.append(master)
        say(f"mooncake_master {master.address}, http metadata {master.metadata_url}")
        extra = {"master_server_address": master.address, "metadata_server": master.metadata_url,
                 "global_segment_size": "256MB"}  # fmt: skip
        kv = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": extra})  # fmt: skip
        say(f"prefill and decode: python -m vllm.entrypoints.openai.api_server --model {model} "
            f"--kv-transfer-config '{kv}'  (starting; a few minutes on 2 cores)")  # fmt: skip
        specs = [ServerSpec(n, args=["--kv-transfer-config", kv]) for n in ("prefill", "decode")]
        prefill, decode = start_many(model, specs, log_dir=log_dir)
        started += [prefill, decode]
        port = servers.free_port()
        proxy_url = f"http://127.0.0.1:{port}"
        argv = ["--prefill", prefill.url, "--decode", decode.url, "--port", str(port),
                "--mode", "pool"]  # fmt: skip
        proxy = servers.ManagedProcess(
            "proxy", [sys.executable, "-m", "mooncake_vllm.proxy.server", *argv],
            log_dir / "proxy.log",
        ).start()  # fmt: skip
        started.append(proxy)
        proxy.wait_until(lambda: servers.http_text(f"{proxy_url}/health") != "", 60, "healthy")
        say(f"proxy {proxy_url}: python -m mooncake_vllm.proxy.server {' '.join(argv)}")
        asyncio.run(send_requests(proxy_url, model))
        time.sleep(1.5)  # let the servers publish their last step's stats
        report(prefill, decode)
        say(f"logs in {log_dir}; total {time.monotonic() - t0:.0f} s")
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
