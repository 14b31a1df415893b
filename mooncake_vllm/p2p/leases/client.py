"""The producer's leases, as the engine core's scheduler half sees them: a facade over the lease
server process (``leases.process``), which owns the lease tables and serves the side channels.

Why the engine core and not the workers: ``request_finished`` decides there to hold a prompt's
blocks, and the hold reaches the lease server before the handoff leaves the process, so an
``Acquire`` never waits for a step. The workers only register their KV memory (the layout reaches
us through vLLM's handshake metadata) and report the requests whose leases ended as
finished-sending, which frees the blocks (``MooncakeConnectorMetadata``).

One side channel per TP rank. Per-head K/V is sharded by rank: one ``LeaseTable`` per rank,
acquired and released by the consumer ranks that read heads from it (``planning.lease_readers``:
any consumer TP size; the first acquire says how many), and a request's blocks are freed once
every rank's lease has ended. An MLA latent is replicated (every rank holds all of it): one table
for all ranks, each consumer rank pulls the latent once from one producer rank
(``planning.producer_rank_for``), and the request's blocks — on every producer rank — are freed
when all consumer ranks have released it.

Everything here runs on the engine core's scheduler thread: a hold is one write to the socket
pair, and each step reads the lease server's reports without blocking.
"""

from __future__ import annotations

import logging
import secrets
import subprocess
import threading
import time
from collections import Counter

from mooncake_vllm.core.auth import is_loopback
from mooncake_vllm.core.child_process import spawn_child
from mooncake_vllm.p2p.config import ConnectorConfig
from mooncake_vllm.p2p.leases.process import (
    Abort,
    Dropped,
    Ended,
    Hold,
    Layouts,
    RankLayout,
    Ready,
    Start,
    Stop,
    encode,
    report_decoder,
)
from mooncake_vllm.p2p.local_channels import layers_endpoint
from mooncake_vllm.p2p.protocol import Handoff
from mooncake_vllm.p2p.side_channel import SideChannelError

__all__ = ["LeaseService", "RankLayout"]

logger = logging.getLogger(__name__)

# Python's start-up and the imports of zmq and msgspec take well under a second.
_START_TIMEOUT_S = 30.0
# Consumer ranks that may share one lease (a TP size): all of them for an MLA latent, several
# for a per-head rank when the consumer's TP is larger (``planning.lease_readers``).
MAX_READERS = 64


class LeaseService:
    def __init__(self, cfg: ConnectorConfig, wake_endpoint: str, kv_replicated: bool = False):
        s = cfg.settings
        self._ranks = cfg.ranks
        # A replicated MLA latent: one table per pipeline stage, shared by its TP ranks.
        self._tables = cfg.pp_size if kv_replicated else cfg.ranks
        self._max_readers = MAX_READERS
        # This start of the engine: handoffs carry it, and a restarted producer on the same
        # address refuses the ones of its previous life (``SideChannelServer``).
        self.incarnation = secrets.token_hex(8)
        self._dropped: Counter[str] = Counter()
        keys = s.auth_keys()
        if not keys and not is_loopback(cfg.host):
            logger.warning(
                "the side channel listens on %s with no shared secret: anyone who can reach it "
                "can send it frames. Set auth_secret_file or auth_secret_env on both sides "
                "(docs/security.md)",
                cfg.host,
            )
        # A pinned lease outlives the consumer's whole pull: its last attempt ends by the
        # deadline plus one stall timeout.
        self._pull_hold_s = s.load_timeout_s + s.stall_timeout_s + 5.0
        self._lock = threading.Lock()
        self._layouts: dict[int, RankLayout] = {}
        self._held_bytes: dict[str, int] = {}  # req id -> bytes held on all ranks
        self._ended_tables: Counter[str] = Counter()  # req id -> tables whose lease ended
        self._reasons: Counter[str] = Counter()
        self._by_request: dict[str, str] = {}  # req id -> why its lease ended (table 0)
        self._finished: set[str] = set()
        self._gone_at: float | None = None  # when the lease server was found gone
        self.addresses = [f"{cfg.host}:{cfg.side_channel_port(r)}" for r in range(cfg.ranks)]
        # ``layerwise_handoff``: the token the workers' layer marks carry (step metadata).
        self.layers_token = secrets.token_bytes(16) if s.layerwise_handoff else b""

        self._proc, self._conn = spawn_child("mooncake_vllm.p2p.leases.process")
        start = Start(
            host=cfg.host,
            ports=[cfg.side_channel_port(r) for r in range(cfg.ranks)],
            tables=self._tables,
            ttl_s=s.lease_ttl_s,
            budget_bytes=s.kv_buffer_size,
            pull_hold_s=self._pull_hold_s,
            wake_endpoint=wake_endpoint,
            keys=list(keys),
            incarnation=self.incarnation,
            thread_priority=s.thread_priority,
            max_frame_bytes=s.side_channel_max_frame_bytes,
            peer_rate=s.side_channel_peer_rate,
            max_peers=s.side_channel_max_peers,
            layers_endpoint=layers_endpoint(cfg.host, cfg.base_port) if self.layers_token else "",
            layers_token=self.layers_token,
            lease_reasons=cfg.otlp_traces_endpoint is not None,
        )
        try:
            self._conn.send_bytes(encode(start))
            if not self._conn.poll(_START_TIMEOUT_S):
                raise RuntimeError(f"the lease server did not start in {_START_TIMEOUT_S:.0f}s")
            ready = report_decoder.decode(self._conn.recv_bytes())
            if not isinstance(ready, Ready):
                raise RuntimeError(f"the lease server answered {type(ready).__name__}, not Ready")
            if ready.error:
                raise SideChannelError(ready.error)
        except (EOFError, OSError) as e:
            self.close()
            raise RuntimeError(f"the lease server failed to start ({e}); see its log above") from e
        except BaseException:
            self.close()
            raise

    def set_layouts(self, layouts: dict[int, RankLayout]) -> None:
        missing = set(range(self._ranks)) - set(layouts)
        if missing:
            raise RuntimeError(f"no KV layout from producer worker rank(s) {sorted(missing)}")
        self._layouts = dict(layouts)
        self._send(Layouts([layouts[r] for r in range(self._ranks)]))

    def hold(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: list[int],
        handoff: Handoff | None = None,
        *,
        computing: bool = False,
    ) -> bool:
        """Opens the lease on every rank (``handoff``: what a pending acquire of it is granted
        with); False (nothing held) if the lease server is gone, since no consumer could pull
        it. ``computing``: opened in the prefill's last step (``layerwise_handoff``); a second
        hold without it, or ``abort``, follows when the request has finished."""
        per_rank = self._rank_bytes(len(block_ids))
        hold = Hold(
            req_id,
            transfer_id,
            block_ids,
            table_bytes=per_rank[:: self._ranks // self._tables],  # each table's first rank
            max_readers=self._max_readers,
            handoff=handoff,
            computing=computing,
        )
        if not (self._alive() and self._send(hold)):
            return False
        if not computing:  # until then the blocks belong to the running request
            with self._lock:
                self._held_bytes[req_id] = sum(per_rank)
        return True

    def abort(self, req_id: str, transfer_id: str, block_ids: list[int]) -> None:
        """The request of a hold opened computing finished without a handover: its blocks are
        held until the consumers that acquired it have released it (``Ended``)."""
        with self._lock:
            self._held_bytes[req_id] = sum(self._rank_bytes(len(block_ids)))
        if not self._send(Abort(req_id, transfer_id)):
            return  # gone: ``take_finished`` frees the blocks after the longest pull

    def _rank_bytes(self, blocks: int) -> list[int]:
        """The bytes ``blocks`` blocks take on each worker rank."""
        return [blocks * self._layouts[r].bytes_per_block for r in range(self._ranks)]

    def take_finished(self) -> set[str]:
        """Requests whose lease has ended in every table: their blocks can be freed."""
        self._read_reports()
        with self._lock:
            done, self._finished = self._finished, set()
            if self._gone_at is not None and time.monotonic() >= self._gone_at + self._pull_hold_s:
                # No lease server, no side channel: once every pull it granted has ended, the
                # blocks it held are nobody's.
                done |= set(self._held_bytes)
                self._held_bytes.clear()
            return done

    def take_ended_reasons(self) -> dict[str, str]:
        """Why each lease ended (rank 0's table), by request id, since the last call."""
        self._read_reports()
        with self._lock:
            out, self._by_request = self._by_request, {}
            return out

    def take_ended_counts(self) -> dict[str, int]:
        """Leases ended since the last call, by reason (counted on rank 0's table only)."""
        self._read_reports()
        with self._lock:
            out, self._reasons = dict(self._reasons), Counter()
            return out

    def take_dropped_counts(self) -> dict[str, int]:
        """Side-channel frames the lease server dropped since the last call, by reason."""
        self._read_reports()
        with self._lock:
            out, self._dropped = dict(self._dropped), Counter()
            return out

    @property
    def held_count(self) -> int:
        self._read_reports()
        return len(self._held_bytes)

    @property
    def held_bytes(self) -> int:
        """KV bytes held on all ranks."""
        self._read_reports()
        return sum(self._held_bytes.values())

    def _read_reports(self) -> None:
        with self._lock:
            try:
                while self._gone_at is None and self._conn.poll(0):
                    report = report_decoder.decode(self._conn.recv_bytes())
                    if isinstance(report, Ended):
                        self._apply(report)
                    elif isinstance(report, Dropped):
                        self._dropped.update(report.counts)
            except (EOFError, OSError):
                self._lost()

    def _apply(self, report: Ended) -> None:
        self._reasons.update(report.reasons)
        self._by_request.update(report.by_request)
        for req_ids in report.req_ids:
            for req_id in req_ids:
                self._ended_tables[req_id] += 1
                if self._ended_tables[req_id] == self._tables:
                    del self._ended_tables[req_id]
                    self._held_bytes.pop(req_id, None)
                    self._finished.add(req_id)

    def _send(self, msg: Hold | Abort | Layouts | Stop) -> bool:
        try:
            self._conn.send_bytes(encode(msg))
            return True
        except OSError:
            with self._lock:
                self._lost()
            return False

    def _alive(self) -> bool:
        if self._proc.poll() is not None:
            with self._lock:
                self._lost()
        return self._gone_at is None

    def _lost(self) -> None:
        """Under the lock: the lease server has ended. Said once; its leases' blocks are freed
        after the longest pull it could have granted (``take_finished``)."""
        if self._gone_at is None:
            self._gone_at = time.monotonic()
            logger.error(
                "the lease server (pid %d) has ended (exit code %s); finished prefills are no "
                "longer handed over (their decodes compute the prompt). Restart this vLLM",
                self._proc.pid,
                self._proc.poll(),
            )

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._conn.send_bytes(encode(Stop()))
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._conn.close()
