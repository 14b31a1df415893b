"""The producer's bootstrap service: vLLM's upstream HTTP API that its orchestrators ask.

With vLLM's data parallelism on one host (``--data-parallel-size``: one engine core per DP rank),
the first local DP rank's engine serves it, and every other local rank registers its own entry
there (``BootstrapRegistration``) over an abstract Unix socket that only processes of the same
user may use (checked by the peer's credentials), not over HTTP; ``/query`` lists the ranks
registered so far, and the orchestrator picks one by its engine id and sends the prefill leg
to it (header ``X-data-parallel-rank``).

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
signal as a backstop). A SIGTERM or SIGINT while the engine core lives (a signal to vLLM's whole
process group) is logged and ignored: ``/query`` answers while the engine drains, as upstream's
(a thread of its engine core) does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

from mooncake_vllm.core.child_process import die_with_parent, outlive_group_signal, spawn_child
from mooncake_vllm.core.settings import ConfigError
from mooncake_vllm.p2p.config import BOOTSTRAP_PORT_ENV, ConnectorConfig
from mooncake_vllm.p2p.upstream import parse_query, query_body

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_REGISTER_EVERY_S = 0.5  # a DP rank's next try while the first rank's service is not up yet
_MAX_ENTRY_BYTES = 1 << 16


def query_entry(cfg: ConnectorConfig) -> dict:
    """This engine's ``/query`` entry: its DP rank, engine id and side channels."""
    ports = [cfg.side_channel_port(r) for r in range(cfg.ranks)]
    return query_body(cfg.engine_id, cfg.dp_rank, cfg.host, ports, cfg.tp_size)


def register_endpoint(host: str, port: int) -> str:
    """Where the bootstrap on ``host:port`` takes the other local DP ranks' entries (an abstract
    Unix socket: no file to clean up, gone with the process)."""
    return f"\0mooncake-vllm/{host}:{port}/bootstrap"


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

    def __init__(self, cfg: ConnectorConfig):
        self.host, self.port = cfg.bootstrap_listen_host, cfg.bootstrap_port
        self.url = bootstrap_url(self.host, self.port)
        body = query_entry(cfg)
        self._proc, self._conn = spawn_child("mooncake_vllm.p2p.bootstrap")
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


class BootstrapRegistration:
    """A DP rank other than the host's first: registers its ``/query`` entry with the first
    rank's bootstrap service, trying every half second until it is taken (the DP engines start
    together, in any order), from a thread that ``close`` ends."""

    def __init__(self, cfg: ConnectorConfig):
        self._endpoint = register_endpoint(cfg.bootstrap_listen_host, cfg.bootstrap_port)
        self._line = json.dumps(query_entry(cfg)).encode() + b"\n"
        self._where = bootstrap_url(cfg.bootstrap_listen_host, cfg.bootstrap_port)
        self._dp_rank = cfg.dp_rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mc-bootstrap-register", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tries = 0
        while not self._stop.is_set():
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(5.0)
                    sock.connect(self._endpoint)
                    sock.sendall(self._line)
                    answer = sock.makefile("rb").readline().strip()
                if answer == b"ok":
                    logger.info(
                        "DP rank %d listed by the bootstrap on %s", self._dp_rank, self._where
                    )
                    return
                logger.error("the bootstrap on %s refused DP rank %d: %s", self._where,
                             self._dp_rank, answer.decode(errors="replace"))  # fmt: skip
                return
            except OSError as e:
                tries += 1
                if tries == int(30 / _REGISTER_EVERY_S):
                    logger.warning(
                        "DP rank %d: no bootstrap service on %s to register with after 30 s "
                        "(%s); still trying. Does the first local DP rank serve it?",
                        self._dp_rank,
                        self._where,
                        e,
                    )
            self._stop.wait(_REGISTER_EVERY_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# ---- the process -------------------------------------------------------------------------------


def make_app(query: dict):
    """The aiohttp application: ``GET /query`` answers ``query`` (as it is when asked: other DP
    ranks register into it); upstream's ``/register`` is refused (our workers are configured,
    not registered)."""
    from aiohttp import web

    async def get_query(_request: web.Request) -> web.Response:
        return web.Response(body=json.dumps(query).encode(), content_type="application/json")

    async def register(_request: web.Request) -> web.Response:
        return web.json_response(
            {"detail": "this producer's workers are configured, not registered"}, status=403
        )

    app = web.Application(client_max_size=4096)
    app.router.add_get("/query", get_query)
    app.router.add_post("/register", register)
    return app


def take_entry(query: dict, line: bytes, host: str) -> str:
    """Adds a DP rank's registered entry (one ``/query`` entry as JSON) to ``query``; "" when
    taken, else why not. Only new DP ranks, on this host, in upstream's shape."""
    try:
        entry = json.loads(line)
        producers = parse_query(entry)
    except ValueError as e:  # HandoffError is one
        return f"malformed entry ({e})"
    if len(entry) != 1 or any(p.side_channel_host != host for p in producers.values()):
        return f"one DP rank's entry, with its side channels on {host}, is expected"
    (dp_rank,) = entry
    if dp_rank in query:
        return f"DP rank {dp_rank} is listed already"
    query.update(entry)
    logger.info("DP rank %s (engine %s) registered", dp_rank, entry[dp_rank]["engine_id"])
    return ""


def _same_user(writer: asyncio.StreamWriter) -> bool:
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


async def _serve(conn: Connection, host: str, port: int, query: dict) -> None:
    from aiohttp import web

    async def on_register(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not _same_user(writer):
                writer.write(b"another user's process may not register\n")
            else:
                line = await asyncio.wait_for(reader.readline(), 5.0)
                why = take_entry(query, line[:_MAX_ENTRY_BYTES], host)
                writer.write((why or "ok").encode() + b"\n")
            await writer.drain()
        except (OSError, asyncio.TimeoutError) as e:
            logger.info("a DP rank's registration broke off: %s", e)
        finally:
            writer.close()

    runner = web.AppRunner(make_app(query), access_log=None, handle_signals=False)
    await runner.setup()
    registry = None
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
            registry = await asyncio.start_unix_server(
                on_register, path=register_endpoint(host, port), limit=_MAX_ENTRY_BYTES
            )
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
        if registry is not None:
            registry.close()
        await runner.cleanup()


def main() -> None:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    # A drain keeps answering /query, as upstream's (a thread of its engine core) does.
    outlive_group_signal(parent_pid, logger, "answering /query until the engine core stops it")
    die_with_parent(parent_pid)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s [bootstrap] %(message)s"
    )
    conn = Connection(fd)
    start = conn.recv()
    asyncio.run(_serve(conn, start["host"], start["port"], start["query"]))


if __name__ == "__main__":
    main()
