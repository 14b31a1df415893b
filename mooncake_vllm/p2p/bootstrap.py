"""The producer's bootstrap service: vLLM's upstream HTTP API that its orchestrators ask.

vLLM's mooncake proxy, llm-d and Dynamo ``GET http://<prefill host>:<VLLM_MOONCAKE_BOOTSTRAP_PORT,
8998>/query`` for each data-parallel rank's ``engine_id`` (and worker addresses) before they send
a request's two legs (``p2p.upstream``). We answer in upstream's shape, with our values: the
engine id our handoffs carry and our side channels as the worker addresses.

Upstream's workers also ``POST /register`` themselves there; ours are configured, so that path
answers 403 and nothing a client sends changes what ``/query`` says. ``/query`` is readable by
anyone who can reach the port: it tells where the side channels are, which a handoff tells too;
acting on a transfer needs side-channel frames, authenticated by the shared secret when one is
configured (docs/security.md).

A process of its own (``python -m mooncake_vllm.p2p.bootstrap FD PID``), started by the scheduler
half beside the lease server (``BootstrapService``): an HTTP server in the engine core would take
the GIL from vLLM's scheduler thread, and in the lease server from the side channels. It binds
before it reports ready, so a port in use stops the engine at startup with a message naming the
setting; it ends when the engine core closes the socket pair or dies (the kernel's parent-death
signal as a backstop).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from mooncake_vllm.core.settings import ConfigError
from mooncake_vllm.p2p.config import BOOTSTRAP_PORT_ENV, ConnectorConfig
from mooncake_vllm.p2p.upstream import query_body

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0


def bootstrap_url(host: str, port: int) -> str:
    """How clients name a bootstrap service (upstream's ``remote_bootstrap_addr``)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def clash_message(host: str, port: int, error: str) -> str:
    return (
        f"the bootstrap service cannot listen on {host}:{port} ({error}): another engine on this "
        f"host uses that port? Give each producer on a host its own port with bootstrap_port in "
        f"kv_connector_extra_config (or {BOOTSTRAP_PORT_ENV}), or 0 for no bootstrap service"
    )


class BootstrapService:
    """The engine core's handle on the bootstrap process: started and bound on construction
    (raises ``ConfigError`` when the port is taken), ended by ``close``."""

    def __init__(self, cfg: ConnectorConfig, dp_rank: int = 0):
        self.host, self.port = cfg.host, cfg.bootstrap_port
        self.url = bootstrap_url(self.host, self.port)
        body = query_body(
            cfg.engine_id,
            dp_rank,
            cfg.host,
            [cfg.side_channel_port(r) for r in range(cfg.tp_size)],
        )
        ours, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mooncake_vllm.p2p.bootstrap",
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=(theirs.fileno(),),
            )
        self._conn = Connection(ours.detach())
        try:
            self._conn.send({"host": self.host, "port": self.port, "query": body})
            if not self._conn.poll(_START_TIMEOUT_S):
                raise RuntimeError(
                    f"the bootstrap service did not start in {_START_TIMEOUT_S:.0f}s"
                )
            error = self._conn.recv()
        except (EOFError, OSError) as e:
            self.close()
            raise RuntimeError(f"the bootstrap service failed to start ({e}); see its log") from e
        except BaseException:
            self.close()
            raise
        if error:
            self.close()
            raise ConfigError(clash_message(self.host, self.port, error))
        logger.info("bootstrap service (vLLM's /query) on %s", self.url)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._conn.close()  # end of file: the process stops
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._conn.close()


# ---- the process -------------------------------------------------------------------------------


def make_app(query: dict):
    """The aiohttp application: ``GET /query`` answers ``query``; upstream's ``/register`` is
    refused (our workers are configured, not registered)."""
    from aiohttp import web

    payload = json.dumps(query).encode()

    async def get_query(_request: web.Request) -> web.Response:
        return web.Response(body=payload, content_type="application/json")

    async def register(_request: web.Request) -> web.Response:
        return web.json_response(
            {"detail": "this producer's workers are configured, not registered"}, status=403
        )

    app = web.Application(client_max_size=4096)
    app.router.add_get("/query", get_query)
    app.router.add_post("/register", register)
    return app


async def _serve(conn: Connection, host: str, port: int, query: dict) -> None:
    from aiohttp import web

    runner = web.AppRunner(make_app(query), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            conn.send(e.strerror or str(e))
            return
        conn.send("")
        # Serve until the engine core closes the socket pair (or dies).
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: ended.done() or ended.set_result(None))
        await ended
    finally:
        await runner.cleanup()


def main() -> None:
    from mooncake_vllm.p2p.leases.process import _die_with_parent

    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(parent_pid)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s [bootstrap] %(message)s"
    )
    conn = Connection(fd)
    start = conn.recv()
    asyncio.run(_serve(conn, start["host"], start["port"], start["query"]))


if __name__ == "__main__":
    main()
