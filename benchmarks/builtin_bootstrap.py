"""vLLM's own Mooncake bootstrap server, bound to a loopback address (serving benchmark only).

    python -m benchmarks.builtin_bootstrap --host 127.0.0.2 --port 8998

vLLM's built-in MooncakeConnector starts this registry inside the prefill worker on 0.0.0.0. The
benchmark keeps every server on loopback, so it runs the same class here on the prefill's address
and points the prefill at it with ``kv_connector_extra_config.bootstrap_server_address`` (the
connector's documented option for an external bootstrap server).
"""

from __future__ import annotations

import argparse
import signal
import threading


def main() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
        MooncakeBootstrapServer,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    server = MooncakeBootstrapServer(args.host, args.port)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()
