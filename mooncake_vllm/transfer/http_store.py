"""A standalone http metadata server for the transfer engine: ``python -m
mooncake_vllm.transfer.http_store [--host 127.0.0.1] [--port 8080] [--persist FILE]
[--token-file FILE | --token-env VAR]``.

Use it for ``"metadata_server": "http://HOST:PORT/metadata"``. Mooncake ships one too
(``mooncake.http_metadata_server``); this one differs where it matters for serving: a PUT
overwrites (a restarted engine re-registers under its own name; Mooncake's refuses the duplicate
and the engine fails to start), keys may carry a TTL (``?ttl=`` seconds) so a crashed engine's keys
expire, ``--persist`` keeps the keys across a restart of the server, ``GET /health`` answers,
and it binds loopback unless told otherwise.

With ``--token-file``/``--token-env`` every request but ``GET /health`` needs ``Authorization:
Bearer <token>`` (401 otherwise); clients set ``metadata_auth.token_file``/``token_env``. The
token is never taken from the command line, where any user of the host can read it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from pathlib import Path

from aiohttp import web

from mooncake_vllm.metadata import MemoryStore, read_secret
from mooncake_vllm.transfer.store_bridge import metadata_app


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument(
        "--persist", type=Path, help="JSON file the keys are saved to and loaded from"
    )
    parser.add_argument("--token-file", help="file holding the bearer token clients must send")
    parser.add_argument("--token-env", help="environment variable holding the bearer token")
    args = parser.parse_args(argv)
    try:
        token = read_secret(args.token_file, args.token_env, "--token-file", "--token-env")
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if token is None and not _is_loopback(args.host):
        logging.warning(
            "serving metadata on %s without a token: anyone who reaches it can read and "
            "overwrite the engines' keys; set --token-file or --token-env",
            args.host,
        )
    app = metadata_app(MemoryStore(args.persist), token=token)
    web.run_app(app, host=args.host, port=args.port, access_log=None)


if __name__ == "__main__":
    main()
