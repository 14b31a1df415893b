"""vLLM's upstream MooncakeConnector request convention, turned into ours, and back.

The name ``MooncakeConnector`` comes with the protocol its orchestrators speak (vLLM's
``mooncake_connector_proxy.py``, llm-d's ``--kv-connector mooncake``, Dynamo): they ask the
prefill host's bootstrap service (``GET http://host:8998/query``, ``p2p.bootstrap``) for each data
parallel rank's ``engine_id``, choose a ``transfer_id`` (``xfer-<uuid4>``) and send both legs at
once::

    prefill: {"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": T}
    decode:  {"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": T,
              "remote_bootstrap_addr": "http://host:8998", "remote_engine_id": E}

The producer half needs nothing of this module: it already takes ``{do_remote_decode,
transfer_id}`` (``protocol.is_transfer_id`` accepts upstream's ids). The decode's params become a
``PendingHandoff`` named by its bootstrap (``to_pending``); the worker's pull job resolves it to
the producer's side channels with ``BootstrapResolver`` (off the scheduler's thread, under the
load's deadline), and from there it is our pending handoff: the acquire waits at the producer
until the prefill's lease exists, and leases, deadlines, ``kv_load_failure_policy``, layouts and
auth are the same as for our own proxy's ``--dispatch concurrent``. Nothing else branches on the
convention.

The ``/query`` answer keeps upstream's shape (``query_body``): ``{dp_rank: {"engine_id": E,
"worker_addr": {tp_rank: {pp_rank: "tcp://host:port"}}}}``; our worker addresses are the side
channels of the producer's TP ranks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from mooncake_vllm.p2p.protocol import (
    MAX_PP_SIZE,
    MAX_TRANSFER_ID,
    TRANSFER_ID_CHARS,
    Handoff,
    HandoffError,
    PendingHandoff,
    is_transfer_id,
    parse_handoff,
    parse_pending,
)

logger = logging.getLogger(__name__)

# The keys that mark the decode leg of upstream's convention.
UPSTREAM_KEYS = ("remote_bootstrap_addr", "remote_engine_id")
# One ``/query`` at most this long in all (connect to last byte), whatever the load's deadline
# (orchestrators use 5 s).
QUERY_TIMEOUT_S = 5.0
# Bootstrap services remembered per consumer worker (least recently used forgotten first).
MAX_BOOTSTRAPS = 256
MAX_QUERY_BYTES = 1 << 20


def is_upstream(params: dict[str, Any]) -> bool:
    """``kv_transfer_params`` of upstream's decode leg (not our handoff, which names blocks)."""
    return "remote_block_ids" not in params and any(k in params for k in UPSTREAM_KEYS)


def parse_consumer_params(params: dict[str, Any]) -> Handoff | PendingHandoff:
    """The handoff in a decode request's ``kv_transfer_params``, in any convention: our
    producer's ``Handoff`` (NIXL-style: the prefill answered, the decode got the answer), our
    proxy's pending handoff (``--dispatch concurrent``) or upstream's (``to_pending``). Raises
    HandoffError naming the problem."""
    if is_upstream(params):
        return to_pending(params)
    if params.get("pending"):
        return parse_pending(params)
    return parse_handoff(params)


def to_pending(params: dict[str, Any]) -> PendingHandoff:
    """Upstream's decode params as a pending handoff named by its bootstrap; raises
    HandoffError."""
    transfer_id = params.get("transfer_id")
    engine_id = params.get("remote_engine_id")
    addr = params.get("remote_bootstrap_addr")
    if not is_transfer_id(transfer_id):
        shown = repr(transfer_id)[:80]
        raise HandoffError(
            f"transfer_id {shown} is not one a producer takes: 1-{MAX_TRANSFER_ID} "
            f"{TRANSFER_ID_CHARS} (upstream's orchestrators send xfer-<uuid> or a uuid)"
        )
    if not isinstance(engine_id, str) or not engine_id:
        raise HandoffError(f"remote_engine_id {engine_id!r} must name the prefill's engine")
    bootstrap_host(addr)  # raises on a malformed address
    return PendingHandoff(
        transfer_id=transfer_id, producer_engine_id=engine_id, bootstrap_addr=addr
    )


def bootstrap_host(addr: object) -> str:
    """The host of a ``remote_bootstrap_addr`` (``http://host:port``); raises HandoffError."""
    if not isinstance(addr, str):
        raise HandoffError(f"remote_bootstrap_addr {addr!r} must be 'http://host:port'")
    try:
        parts = urlsplit(addr)
        port = parts.port
    except ValueError as e:
        raise HandoffError(f"remote_bootstrap_addr {addr!r}: {e}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise HandoffError(f"remote_bootstrap_addr {addr!r} must be 'http://host:port'")
    if parts.path not in ("", "/") or parts.query or parts.username:
        raise HandoffError(f"remote_bootstrap_addr {addr!r} must be 'http://host:port' alone")
    return parts.hostname


def producer_params(handoff: Handoff, bootstrap_addr: str) -> dict[str, Any]:
    """What a producer answers in ``kv_transfer_params``: our handoff (the decode may take it as
    it is), and where a client of upstream's convention finds this engine (``bootstrap_addr``
    empty: no bootstrap service)."""
    params = handoff.to_params()
    if bootstrap_addr:
        params["remote_engine_id"] = handoff.producer_engine_id
        params["remote_bootstrap_addr"] = bootstrap_addr
    return params


# ---- /query --------------------------------------------------------------------------------


def worker_addr(host: str, port: int) -> str:
    """A side channel as upstream writes a worker's address (ZeroMQ's ``tcp://h:p``)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def query_body(
    engine_id: str, dp_rank: int, host: str, ports: list[int], tp_size: int | None = None
) -> dict[str, Any]:
    """The ``/query`` answer of one engine (one data-parallel rank), in upstream's shape:
    ``worker_addr[tp_rank][pp_rank]``; ``ports`` by worker rank (PP rank × ``tp_size`` + TP
    rank; ``tp_size`` None: one pipeline stage)."""
    tp = tp_size or len(ports)
    stages = range(len(ports) // tp)
    return {
        str(dp_rank): {
            "engine_id": engine_id,
            "worker_addr": {
                str(t): {str(s): worker_addr(host, ports[s * tp + t]) for s in stages}
                for t in range(tp)
            },
        }
    }


@dataclass(frozen=True)
class Producer:
    """One engine as its bootstrap service describes it."""

    engine_id: str
    side_channel_host: str
    side_channel_ports: list[int]  # by worker rank: PP rank × TP size + TP rank
    tp_size: int = 0  # 0: one per port
    pp_size: int = 1


def parse_query(data: object) -> dict[str, Producer]:
    """A ``/query`` answer, by engine id; raises HandoffError naming what is wrong."""
    if not isinstance(data, dict):
        raise HandoffError("the /query answer is not a JSON object")
    out: dict[str, Producer] = {}
    for dp_rank, entry in data.items():
        try:
            engine_id = entry["engine_id"]
            # worker_addr[tp_rank][pp_rank]
            ranks = {
                int(tp): {int(pp): a for pp, a in pps.items()}
                for tp, pps in entry["worker_addr"].items()
            }
            if not isinstance(engine_id, str) or sorted(ranks) != list(range(len(ranks))):
                raise ValueError("engine_id or TP ranks")
            stages = {pp for pps in ranks.values() for pp in pps}
            if sorted(stages) != list(range(len(stages))) or len(stages) > MAX_PP_SIZE:
                raise ValueError(f"PP ranks {sorted(stages)[:8]}")
            addrs = [
                _split_worker_addr(ranks[t][s])
                for s in range(len(stages))
                for t in range(len(ranks))
            ]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise HandoffError(f"/query entry of DP rank {dp_rank} is malformed ({e})") from e
        hosts = {h for h, _ in addrs}
        if len(hosts) != 1 or not addrs:
            raise HandoffError(f"/query entry of DP rank {dp_rank}: TP ranks on hosts {hosts}")
        out[engine_id] = Producer(
            engine_id, hosts.pop(), [p for _, p in addrs], len(ranks), len(stages)
        )
    return out


def _split_worker_addr(addr: object) -> tuple[str, int]:
    if not isinstance(addr, str) or not addr.startswith("tcp://"):
        raise ValueError(f"worker address {addr!r} is not 'tcp://host:port'")
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


# ---- the consumer worker's resolver ----------------------------------------------------------


class BootstrapError(Exception):
    """A pending handoff that cannot be resolved; the message names the bootstrap and why."""


class BootstrapResolver:
    """Resolves upstream-named pending handoffs to side channels, for a consumer worker.

    Cached per bootstrap address: each address's last ``/query`` answer, by engine id. An engine
    id the cache lacks (a new engine, or one restarted behind the same address: vLLM gives every
    start a new id) asks the bootstrap again. Called from pull jobs (several threads); a query
    runs outside the lock, so one slow bootstrap delays only the pulls that need it."""

    def __init__(self, fetch=None, max_bootstraps: int = MAX_BOOTSTRAPS):
        self._fetch = fetch or fetch_query
        self._max = max_bootstraps
        self._lock = threading.Lock()
        self._known: OrderedDict[str, dict[str, Producer]] = OrderedDict()

    def resolve(self, pending: PendingHandoff, timeout_s: float) -> PendingHandoff:
        """``pending`` with the producer's side channels; raises BootstrapError."""
        if not pending.unresolved:
            return pending
        addr, engine_id = pending.bootstrap_addr.rstrip("/"), pending.producer_engine_id
        producer = self._cached(addr, engine_id)
        if producer is None:
            producer = self._refresh(addr, timeout_s).get(engine_id)
        if producer is None:
            known = sorted(self._cached_ids(addr))
            raise BootstrapError(
                f"unknown remote_engine_id {engine_id!r}: the bootstrap {addr} serves "
                f"{known or 'no engine'} (was the prefill restarted? ask /query again)"
            )
        return PendingHandoff(
            transfer_id=pending.transfer_id,
            producer_engine_id=engine_id,
            side_channel_host=producer.side_channel_host,
            side_channel_ports=list(producer.side_channel_ports),
            producer_tp_size=producer.tp_size or len(producer.side_channel_ports),
            producer_pp_size=producer.pp_size,
            bootstrap_addr=pending.bootstrap_addr,
        )

    def _cached(self, addr: str, engine_id: str) -> Producer | None:
        with self._lock:
            engines = self._known.get(addr)
            if engines is None:
                return None
            self._known.move_to_end(addr)
            return engines.get(engine_id)

    def _cached_ids(self, addr: str) -> list[str]:
        with self._lock:
            return list(self._known.get(addr, {}))

    def _refresh(self, addr: str, timeout_s: float) -> dict[str, Producer]:
        if timeout_s <= 0:
            raise BootstrapError(f"no time left to ask the bootstrap {addr}")
        try:
            engines = parse_query(self._fetch(addr, min(timeout_s, QUERY_TIMEOUT_S)))
        except HandoffError as e:
            raise BootstrapError(f"the bootstrap {addr} answered badly: {e}") from e
        except Exception as e:
            raise BootstrapError(
                f"the bootstrap {addr} did not answer /query ({type(e).__name__}: {e})"
            ) from e
        with self._lock:
            self._known[addr] = engines
            self._known.move_to_end(addr)
            while len(self._known) > self._max:
                self._known.popitem(last=False)
        return engines


def fetch_query(addr: str, timeout_s: float) -> object:
    """``GET {addr}/query``, parsed; raises on any failure (a redirect or another status than
    200 included: the bootstrap named is the one asked). ``timeout_s`` bounds the whole call,
    from the connect to the answer's last byte, so a bootstrap that trickles its answer holds
    a pull thread no longer than that. Runs on the calling thread (a pull job's), in an event
    loop of its own: resolves are few (the resolver caches their answers)."""
    started = time.monotonic()
    try:
        body = asyncio.run(asyncio.wait_for(_get_query(addr), timeout_s))
    except TimeoutError:
        raise TimeoutError(f"no whole answer in {timeout_s:.1f}s") from None
    logger.debug("asked %s/query in %.1f ms", addr, 1000 * (time.monotonic() - started))
    return json.loads(body)


async def _get_query(addr: str) -> bytes:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{addr}/query", allow_redirects=False) as resp,
    ):
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status} {resp.reason or ''}".rstrip())
        body = bytearray()
        async for chunk in resp.content.iter_any():
            body += chunk
            if len(body) > MAX_QUERY_BYTES:
                raise ValueError(f"answer over {MAX_QUERY_BYTES} bytes")
        return bytes(body)
