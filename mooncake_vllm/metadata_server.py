"""A standalone http metadata server for the transfer engine: ``python -m
mooncake_vllm.metadata_server [--host 127.0.0.1] [--port 8080] [--persist FILE]``.

Use it for ``"metadata_server": "http://HOST:PORT/metadata"``. Mooncake ships one too
(``mooncake.http_metadata_server``); this one differs where it matters for serving: a PUT
overwrites (a restarted engine re-registers under its own name; Mooncake's refuses the duplicate
and the engine fails to start), keys may carry a TTL (``?ttl=`` seconds) so a crashed engine's keys
expire, ``--persist`` keeps the keys across a restart of the server, ``GET /health`` answers,
and it binds loopback unless told otherwise.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from aiohttp import web

from mooncake_vllm.metadata import MemoryStore
from mooncake_vllm.metadata_bridge import metadata_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument(
        "--persist", type=Path, help="JSON file the keys are saved to and loaded from"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = metadata_app(MemoryStore(args.persist))
    web.run_app(app, host=args.host, port=args.port, access_log=None)


if __name__ == "__main__":
    main()
