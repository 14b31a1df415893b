"""How fast our KV pull moves bytes, against the raw transfer engine, a loopback socket and memcpy,
and how fast it moves them into a consumer of another layout.

    python -m benchmarks.transfer [--full] [--out-dir artifacts/bench]

Two processes play the two hosts: a producer (``benchmarks.transfer_peer``, 127.0.0.2) holding
KV-shaped layer buffers registered with a transfer engine, and this process as the consumer
(127.0.0.3), TCP transport, P2P-handshake metadata — the connector's setup on this machine. The
producer is one TP1 rank with vLLM 0.32's CPU layout (``KvShape``). For each KV shape and prompt
length, our pull runs in three consumer layouts, each moving the bytes a real pull would move:

- ``same`` (same TP, same block size): ``plan_pull``, which here is ``plan_regions`` of whole
  blocks over the layer segments (``tensor_segments``), then ``TransferAgent.read``
  (``mooncake_vllm.transfer.engine``: one-entry batches, non-blocking status polls, deadline);
- ``tp-split``: the consumer is rank 1 of a TP2 decode and reads its half of the heads:
  ``plan_pull`` over segments described down to each head's slab of a block
  (``tokens_addressable=False``), one region per (layer, block), into layer buffers of half the
  heads; half the bytes of ``same``;
- ``block-resize``: the consumer's blocks are half the producer's: the decode worker's
  ``core.reblock.pull_through_staging`` with a 64 MiB staging buffer (the connector's default
  ``reblock_buffer_bytes``): chunks read by ``TransferAgent.read`` into one half while the chunk
  before is rearranged (``scatter_tokens``) from the other. Timed whole, the last chunk's
  scatter included (it is on the decode's critical path); ``scatter`` is the time spent
  scattering over the pull's time (overlapped with reads, so not a share of it).

and the ``same`` bytes also move three other ways:

- ``raw_te``: the bare ``mooncake.engine`` object, one ``batch_transfer_sync_read`` of the same
  number of bytes per layer cut in large (``--chunk-mib``) contiguous chunks;
- ``socket``: the producer sends the same number of bytes over a loopback TCP socket;
- ``memcpy``: ``numpy.copyto`` of the same number of bytes within this process.

Everything is interleaved sample by sample. ``vs_same`` is a layout's GB/s over ``same``'s in the
same cell (the target for a re-laid-out pull: at least 0.8). Block ids are either contiguous (a
fresh cache) or scattered (a seeded random choice: the worst case for region merging), the
``ids`` column. Every pull is checked against the bytes the producer wrote: whole blocks for
``same``, the heads' slabs for ``tp-split``, every token of every head in order for
``block-resize`` (K and V rebuilt in token order on both sides, the rule ``core.reblock`` states).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from benchmarks import common
from benchmarks.transfer_peer import allocate, block_content
from mooncake_vllm.core.planning import MemSegment, plan_pull, rank_heads, tensor_segments
from mooncake_vllm.core.reblock import pull_through_staging
from mooncake_vllm.transfer.engine import ReadResult, TransferAgent

PRODUCER_HOST, CONSUMER_HOST = "127.0.0.2", "127.0.0.3"
METHODS = ["ours", "raw_te", "socket", "memcpy"]
LAYOUTS = ["same", "tp-split", "block-resize"]
MAX_BATCH_ENTRIES = 512  # the connector's default max_batch_entries
STALL_TIMEOUT_S = 2  # the connector's default stall_timeout_s
REBLOCK_BUFFER_BYTES = 64 << 20  # the connector's default reblock_buffer_bytes
SPLIT_TP, SPLIT_RANK = 2, 1  # tp-split: the consumer is this rank of a decode of this TP size


@dataclass(frozen=True)
class KvShape:
    """vLLM 0.32's CPU layout (its ``cpu-vec`` format): one tensor per layer, ``(num_blocks,
    kv_heads, block_size, 2 * head_dim)``, heads outermost inside a block; each head's slab of a
    block is K as ``[head_dim, block_size]`` then V as ``[block_size, head_dim]``
    (``core.reblock``). One segment per layer."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int = 128

    @property
    def block_bytes(self) -> int:
        return 2 * self.kv_heads * self.block_size * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.block_bytes // self.block_size

    @property
    def element(self) -> torch.dtype:
        """The consumer tensors' element: an integer as wide as the KV dtype (the same bytes and
        the same copies; bytes that are NaN as floats compare as themselves)."""
        return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[self.dtype_bytes]


# The tiny test model (8 KiB/token) and a Llama-3-8B-sized KV (32 layers, 8 KV heads, fp16:
# 128 KiB/token).
TINY = KvShape("tiny", layers=4, kv_heads=4, head_dim=64, dtype_bytes=4)
BIG = KvShape("big", layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)


def layer_segments(shape: KvShape, addr: int, num_blocks: int, heads: int) -> list[MemSegment]:
    """One layer tensor of ``heads`` heads at ``addr`` as the connector describes it: each head's
    slab of a block is one unit (``tokens_addressable=False``: tokens are not byte ranges)."""
    dims = (num_blocks, heads, shape.block_size, 2 * shape.head_dim)
    strides = tuple(math.prod(dims[i + 1 :]) for i in range(len(dims)))
    return tensor_segments(
        addr, dims, strides, shape.dtype_bytes, num_blocks,
        block_size=shape.block_size, heads=heads, tokens_addressable=False,
    )  # fmt: skip


def token_order(blocks: torch.Tensor, block_size: int, head_dim: int):
    """K as ``[heads, head_dim, tokens]`` and V as ``[heads, tokens, head_dim]`` of ``blocks``
    (``[n, heads, block_size, 2 * head_dim]`` in the cpu-vec format), tokens in block order."""
    n, heads = blocks.shape[:2]
    flat = blocks.reshape(n, heads, 2 * block_size * head_dim)
    k = flat[:, :, : block_size * head_dim].reshape(n, heads, head_dim, block_size)
    v = flat[:, :, block_size * head_dim :].reshape(n, heads, block_size, head_dim)
    k = k.permute(1, 2, 0, 3).reshape(heads, head_dim, n * block_size)
    v = v.permute(1, 0, 2, 3).reshape(heads, n * block_size, head_dim)
    return k, v


class Ids(NamedTuple):
    """One cell's block ids: the producer's, the consumer's of the same block size, and the
    consumer's of half the block size (``block-resize``)."""

    src: list[int]
    dst: list[int]
    resized: list[int]


class Peer:
    """The producer process; its stdin is its lifeline."""

    def __init__(
        self,
        shape: KvShape,
        num_blocks: int,
        log_dir: Path,
        host: str = PRODUCER_HOST,
        prefix: Sequence[str] = (),
    ):
        argv = [
            *prefix, sys.executable, "-m", "benchmarks.transfer_peer", "--host", host,
            "--layers", str(shape.layers), "--num-blocks", str(num_blocks),
            "--block-bytes", str(shape.block_bytes),
        ]  # fmt: skip
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(log_dir / f"peer-{shape.name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError(f"transfer peer exited; see {self._log.name}")
        info = json.loads(line)
        self.segment: str = info["segment"]
        self.layer_addrs: list[int] = info["layer_addrs"]
        self.socket_addr = tuple(info["socket"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Bench:
    """The consumer side for one KV shape: local buffers of each layout, peer, socket, the
    methods."""

    def __init__(
        self,
        engine: TransferAgent,
        shape: KvShape,
        num_blocks: int,
        peer: Peer,
        staging: torch.Tensor,
    ):
        self.engine, self.shape, self.peer, self.staging = engine, shape, peer, staging
        self.staging_reads = ThreadPoolExecutor(1, thread_name_prefix="staging-read")
        self.num_blocks = num_blocks
        h = shape.kv_heads
        self.remote = [
            seg for addr in peer.layer_addrs for seg in layer_segments(shape, addr, num_blocks, h)
        ]
        # same: every head, the producer's block size.
        self.dst = allocate(shape.layers, num_blocks, shape.block_bytes, fill=False)
        self.local = self._register(self.dst, h)
        # tp-split: this rank's heads.
        self.split_heads = rank_heads(h, SPLIT_TP, SPLIT_RANK)
        n_split = len(self.split_heads)
        self.split_dst = allocate(
            shape.layers, num_blocks, shape.block_bytes * n_split // h, fill=False
        )
        self.split_local = self._register(self.split_dst, n_split)
        # block-resize: every head, blocks of half the size (as many tokens in all); read into
        # staging only, so not registered.
        self.resized_block = shape.block_size // 2
        self.resized = [
            torch.zeros(
                2 * num_blocks, h, self.resized_block, 2 * shape.head_dim, dtype=shape.element
            )
            for _ in range(shape.layers)
        ]
        self.sock = socket.create_connection(peer.socket_addr)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        total = shape.layers * num_blocks * shape.block_bytes
        self.sock_buf = bytearray(total)
        self.copy_src = np.ones(total, dtype=np.uint8)
        self.copy_dst = np.zeros(total, dtype=np.uint8)

    def _register(self, bufs: list[np.ndarray], heads: int) -> list[MemSegment]:
        segments = []
        for buf in bufs:
            self.engine.register(buf.ctypes.data, buf.nbytes)
            segments += layer_segments(self.shape, buf.ctypes.data, self.num_blocks, heads)
        return segments

    def _read(self, regions) -> ReadResult:
        return self.engine.read(
            self.peer.segment,
            regions,
            deadline=time.monotonic() + 60,
            stall_s=STALL_TIMEOUT_S,
            max_in_flight=MAX_BATCH_ENTRIES,
        )

    def _pull(self, local: list[MemSegment], heads: range, tokens: int, ids: Ids) -> dict:
        """A pull planned as the decode worker plans it (``plan_pull``) and read."""
        t0, c0 = time.perf_counter(), time.thread_time()
        b = self.shape.block_size
        regions = plan_pull(
            self.remote, local, heads=heads, src_heads=range(self.shape.kv_heads),
            dst_heads=heads, src_block_size=b, dst_block_size=b, remote_block_ids=ids.src,
            local_block_ids=ids.dst, first_token=0, end_token=tokens,
        )  # fmt: skip
        result = self._read(regions)
        elapsed = time.perf_counter() - t0
        return {"s": elapsed, "bytes": result.bytes, "entries": result.entries,
                "thread_cpu_s": time.thread_time() - c0}  # fmt: skip

    def same(self, tokens: int, ids: Ids) -> dict:
        return self._pull(self.local, range(self.shape.kv_heads), tokens, ids)

    def tp_split(self, tokens: int, ids: Ids) -> dict:
        return self._pull(self.split_local, self.split_heads, tokens, ids)

    def block_resize(self, tokens: int, ids: Ids) -> dict:
        """The decode worker's ``_read_reblocked`` (``core.reblock.pull_through_staging``):
        remote blocks through staging a chunk at a time, each chunk scattered into the
        consumer's smaller blocks while the next is read."""
        t0, c0 = time.perf_counter(), time.thread_time()
        s, heads = self.shape, list(range(self.shape.kv_heads))
        results: list[ReadResult] = []
        scatter_s = pull_through_staging(
            staging=self.staging, src=self.remote, layers=self.resized, heads=heads,
            src_heads=range(len(heads)), first_head=0, src_block_size=s.block_size,
            dst_block_size=self.resized_block, remote_block_ids=ids.src,
            local_block_ids=ids.resized, first_token=0, end_token=tokens,
            read=lambda regions: results.append(self._read(regions)),
            before_writing=lambda: None, submit=self.staging_reads.submit,
        )  # fmt: skip
        elapsed = time.perf_counter() - t0
        return {"s": elapsed, "bytes": sum(r.bytes for r in results),
                "entries": sum(r.entries for r in results), "chunks": len(results),
                "thread_cpu_s": time.thread_time() - c0, "scatter_s": scatter_s}  # fmt: skip

    def raw_te(self, nbytes_per_layer: int, chunk_bytes: int) -> dict:
        dsts, srcs, lens = [], [], []
        for layer, buf in enumerate(self.dst):
            for off in range(0, nbytes_per_layer, chunk_bytes):
                n = min(chunk_bytes, nbytes_per_layer - off)
                dsts.append(buf.ctypes.data + off)
                srcs.append(self.peer.layer_addrs[layer] + off)
                lens.append(n)
        # The bare engine object, on purpose: this is the baseline the wrapper is measured against.
        te = self.engine._te
        t0, c0 = time.perf_counter(), time.thread_time()
        rc = te.batch_transfer_sync_read(self.peer.segment, dsts, srcs, lens)
        elapsed = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_read returned {rc}")
        return {"s": elapsed, "bytes": sum(lens), "entries": len(lens),
                "thread_cpu_s": time.thread_time() - c0}  # fmt: skip

    def socket(self, nbytes: int) -> dict:
        view = memoryview(self.sock_buf)
        t0 = time.perf_counter()
        self.sock.sendall(struct.pack("!Q", nbytes))
        got = 0
        while got < nbytes:
            n = self.sock.recv_into(view[got:nbytes])
            if n == 0:
                raise RuntimeError("socket peer closed")
            got += n
        return {"s": time.perf_counter() - t0, "bytes": nbytes, "entries": 1}

    def memcpy(self, nbytes: int) -> dict:
        t0 = time.perf_counter()
        np.copyto(self.copy_dst[:nbytes], self.copy_src[:nbytes])
        return {"s": time.perf_counter() - t0, "bytes": nbytes, "entries": 1}

    def clear(self) -> None:
        """Zero every layout's destination, so a check sees only what the next pull wrote."""
        for buf in (*self.dst, *self.split_dst):
            buf.fill(0)
        for t in self.resized:
            t.zero_()

    def check(self, tokens: int, ids: Ids, layouts: Sequence[str] = LAYOUTS) -> None:
        """Every layout's pull holds the producer's bytes: whole blocks (``same``), this rank's
        heads' slabs (``tp-split``), every head's K and V of every prompt token in token order
        (``block-resize``)."""
        s, n = self.shape, len(ids.src)
        heads = self.split_heads
        for layer in range(s.layers):
            want = block_content(layer, ids.src, s.block_bytes)
            if not np.array_equal(self.dst[layer][ids.dst], want):
                raise AssertionError(f"same: layer {layer} blocks {ids.dst} hold wrong bytes")
            if layouts == ["same"]:
                continue
            slabs = want.reshape(n, s.kv_heads, -1)[:, heads.start : heads.stop].reshape(n, -1)
            if not np.array_equal(self.split_dst[layer][ids.dst], slabs):
                raise AssertionError(f"tp-split: layer {layer} heads {heads} hold wrong bytes")
            produced = torch.from_numpy(want).view(s.element)
            produced = produced.view(n, s.kv_heads, s.block_size, 2 * s.head_dim)
            k_want, v_want = token_order(produced, s.block_size, s.head_dim)
            k_got, v_got = token_order(
                self.resized[layer][ids.resized], self.resized_block, s.head_dim
            )
            if not (
                torch.equal(k_got[:, :, :tokens], k_want[:, :, :tokens])
                and torch.equal(v_got[:, :tokens], v_want[:, :tokens])
            ):
                raise AssertionError(f"block-resize: layer {layer} tokens out of place")

    def close(self) -> None:
        self.sock.close()
        self.staging_reads.shutdown()


def block_ids(tokens: int, shape: KvShape, num_blocks: int, kind: str, rng: random.Random) -> Ids:
    n = -(-tokens // shape.block_size)
    m = -(-tokens // (shape.block_size // 2))
    if kind == "contiguous":
        return Ids(list(range(n)), list(range(n)), list(range(m)))
    return Ids(
        rng.sample(range(num_blocks), n),
        rng.sample(range(num_blocks), n),
        rng.sample(range(2 * num_blocks), m),
    )


def run(shapes, prompts, id_kinds, reps: int, chunk_bytes: int, log_dir: Path, seed: int = 0):
    samples = []
    rng = random.Random(seed)
    engine = TransferAgent(
        CONSUMER_HOST, "P2PHANDSHAKE", "tcp", "",
        env={"MC_FORCE_TCP": "1", "MC_TCP_BIND_ADDRESS": CONSUMER_HOST,
             "MC_TCP_PROGRESS_TIMEOUT_SEC": str(STALL_TIMEOUT_S)},
    )  # fmt: skip
    # The decode worker's staging buffer: allocated and registered once.
    staging = torch.empty(REBLOCK_BUFFER_BYTES, dtype=torch.uint8)
    engine.register(staging.data_ptr(), REBLOCK_BUFFER_BYTES)
    cases = [(s, p, k) for s in shapes for p in prompts[s.name] for k in id_kinds]
    bar = tqdm(total=len(cases) * reps, desc="transfer samples", file=sys.stderr)
    try:
        for shape in shapes:
            max_blocks = -(-max(prompts[shape.name]) // shape.block_size)
            num_blocks = max(2 * max_blocks, 8)
            peer = Peer(shape, num_blocks, log_dir)
            bench = Bench(engine, shape, num_blocks, peer, staging)
            try:
                for tokens, kind in [(p, k) for p in prompts[shape.name] for k in id_kinds]:
                    ids = block_ids(tokens, shape, num_blocks, kind, rng)
                    per_layer = len(ids.src) * shape.block_bytes
                    total = per_layer * shape.layers
                    calls = {
                        ("ours", "same"): functools.partial(bench.same, tokens, ids),
                        ("ours", "tp-split"): functools.partial(bench.tp_split, tokens, ids),
                        ("ours", "block-resize"): functools.partial(
                            bench.block_resize, tokens, ids
                        ),
                        ("raw_te", "same"): functools.partial(bench.raw_te, per_layer, chunk_bytes),
                        ("socket", "same"): functools.partial(bench.socket, total),
                        ("memcpy", "same"): functools.partial(bench.memcpy, total),
                    }
                    # Warm-up (the first read of a peer handshakes), checking our pulls into
                    # cleared destinations before raw_te overwrites same's.
                    bench.clear()
                    for layout in LAYOUTS:
                        calls["ours", layout]()
                    bench.check(tokens, ids)
                    for (method, _), call in calls.items():
                        if method != "ours":
                            call()
                    for rep in range(reps):
                        for (method, layout), call in calls.items():
                            out = call()
                            samples.append(
                                {
                                    "shape": shape.name, "prompt_tokens": tokens, "ids": kind,
                                    "blocks": len(ids.src), "layout": layout, "method": method,
                                    "rep": rep, **out,
                                }
                            )  # fmt: skip
                        bar.update()
            finally:
                bench.close()
                peer.stop()
    finally:
        bar.close()
        engine.close()
    return samples


def tbf_row(shape: KvShape, tokens: int, rate: str, reps: int, log_dir: Path) -> dict:
    """``same`` pulls across two network namespaces (``harness.netns``) whose link to the
    consumer is capped by ``tc tbf`` at ``rate``: the measured pull time against bytes / rate."""
    from harness.netns import Network

    rate_bit_s = _tc_rate_bit_s(rate)
    with Network() as net:
        prod, cons = net.add_host("producer"), net.add_host("consumer")
        net.cap("consumer", rate)
        num_blocks = max(2 * -(-tokens // shape.block_size), 8)
        peer = Peer(shape, num_blocks, log_dir, prod.address, net.argv("producer", []))
        # The engine's threads start in this thread's namespace: the consumer's.
        with net.entered("consumer"):
            engine = TransferAgent(
                cons.address, "P2PHANDSHAKE", "tcp", "",
                env={"MC_FORCE_TCP": "1", "MC_TCP_BIND_ADDRESS": cons.address,
                     "MC_TCP_PROGRESS_TIMEOUT_SEC": str(STALL_TIMEOUT_S)},
            )  # fmt: skip
            staging = torch.empty(1, dtype=torch.uint8)
            bench = Bench(engine, shape, num_blocks, peer, staging)
            try:
                ids = block_ids(tokens, shape, num_blocks, "contiguous", random.Random(0))
                bench.clear()
                bench.same(tokens, ids)  # warm-up: the handshake
                bench.check(tokens, ids, ["same"])
                pulls = [bench.same(tokens, ids) for _ in range(reps)]
            finally:
                bench.close()
                peer.stop()
                engine.close()
    nbytes = pulls[0]["bytes"]
    seconds = sorted(p["s"] for p in pulls)
    ideal_s = nbytes * 8 / rate_bit_s
    median_s = seconds[len(seconds) // 2]
    return {
        "shape": shape.name, "prompt_tokens": tokens, "ids": "contiguous", "layout": "same",
        "method": f"ours, netns, tbf {rate}", "bytes": nbytes, "reps": reps,
        "median_s": round(median_s, 4), "min_s": round(seconds[0], 4),
        "bytes_over_rate_s": round(ideal_s, 4), "median_over_ideal": round(median_s / ideal_s, 3),
    }  # fmt: skip


def _tc_rate_bit_s(rate: str) -> float:
    """tc's rate units (``1gbit``, ``500mbit``, ``100kbit``) in bit/s."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"--tbf-rate {rate!r}: a number and one of {', '.join(units)} (1gbit)")


def summarize(samples: list[dict]) -> list[dict]:
    keys = sorted({(s["shape"], s["prompt_tokens"], s["ids"]) for s in samples},
                  key=lambda k: (k[0] != "tiny", k[0], k[1], k[2]))  # fmt: skip
    rows = []
    for shape, tokens, kind in keys:
        case = [
            s
            for s in samples
            if (s["shape"], s["prompt_tokens"], s["ids"]) == (shape, tokens, kind)
        ]

        def of(method: str, layout: str = "same", case=case) -> list[dict]:
            return [s for s in case if s["method"] == method and s["layout"] == layout]

        # CPU of the calling thread per second of pull: ~1.0 is a spin, ours sleeps between polls.
        def busy(samples: list[dict]) -> float:
            return common.median([s["thread_cpu_s"] / s["s"] for s in samples])

        same_bytes = of("ours")[0]["bytes"]
        gbps = {m: same_bytes / common.median([s["s"] for s in of(m)]) / 1e9 for m in METHODS}
        # The baselines move same's bytes: shown on same's row, "-" on the others.
        baselines = {
            **{f"{m}_GB/s": gbps[m] for m in METHODS[1:]},
            "ours/raw": gbps["ours"] / gbps["raw_te"],
            "ours/socket": gbps["ours"] / gbps["socket"],
            "ours/memcpy": gbps["ours"] / gbps["memcpy"],
        }
        for layout in LAYOUTS:
            ours = of("ours", layout)
            if not ours:
                continue
            seconds = common.median([s["s"] for s in ours])
            nbytes = ours[0]["bytes"]
            is_same = layout == "same"
            scatter = None
            if "scatter_s" in ours[0]:
                scatter = common.median([s["scatter_s"] / s["s"] for s in ours])
            rows.append(
                {
                    "shape": shape, "tokens": tokens, "ids": kind, "layout": layout,
                    "MB": nbytes / 1e6, "regions": ours[0]["entries"], "ours_ms": seconds * 1000,
                    "ours_GB/s": nbytes / seconds / 1e9,
                    "vs_same": nbytes / seconds / 1e9 / gbps["ours"], "scatter": scatter,
                    **{k: v if is_same else None for k, v in baselines.items()},
                    "ours_cpu": busy(ours), "raw_cpu": busy(of("raw_te")) if is_same else None,
                }
            )  # fmt: skip
    return rows


def minor_label(value: float, _pos: int) -> str:
    """A log axis' minor tick label for 2, 3 and 5 times a power of ten (the rest stay blank)."""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if any(math.isclose(mantissa, m) for m in (2, 3, 5)) else ""


def plot(rows: list[dict]):
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter, FuncFormatter

        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        fig, axes = plt.subplots(
            1, len(shapes), figsize=(5.5 * len(shapes) + 2.5, 4.2), squeeze=False
        )
        colors = {"same": "#1f77b4", "tp-split": "#9467bd", "block-resize": "#d62728",
                  "raw_te": "#2ca02c", "socket": "#ff7f0e", "memcpy": "#7f7f7f"}  # fmt: skip
        # Scattered ids (the worst case) drawn solid, and the baselines with them.
        kinds = sorted({r["ids"] for r in rows}, key=lambda k: k != "scattered")
        for ax, shape in zip(axes[0], shapes, strict=True):
            for kind in kinds:
                style = "-" if kind == kinds[0] else "--"
                for layout in LAYOUTS:
                    sel = [
                        r
                        for r in rows
                        if (r["shape"], r["ids"], r["layout"]) == (shape, kind, layout)
                    ]
                    x = [r["tokens"] for r in sel]
                    ax.plot(
                        x,
                        [r["ours_GB/s"] for r in sel],
                        style,
                        marker="o",
                        color=colors[layout],
                        label=f"ours, {layout} ({kind} blocks)",
                    )
                    if layout != "same" or kind != kinds[0]:
                        continue  # the baselines do not depend on the layout or the block ids
                    for m in METHODS[1:]:
                        ax.plot(
                            x,
                            [r[f"{m}_GB/s"] for r in sel],
                            ":",
                            marker=".",
                            color=colors[m],
                            label=f"{m} (same's bytes)",
                        )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(FuncFormatter(minor_label))
            ax.tick_params(axis="y", which="minor", labelsize=7)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("GB/s (median, log scale)")
            ax.set_title(f"KV shape '{shape}'")
            ax.grid(alpha=0.3, which="both")
        axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        common.save_figure(
            fig, path, "KV pull bandwidth by consumer layout: transfer engine over TCP loopback"
        )

    return draw


def main(argv: list[str] | None = None) -> int:
    # The engine logs every synchronous batch at INFO (glog); keep warnings. Read at its import.
    os.environ.setdefault("GLOG_minloglevel", "1")
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="samples per case (quick 5, full 20)")
    ap.add_argument("--tokens", type=int, nargs="*", default=None, help="prompt lengths")
    ap.add_argument("--shapes", nargs="*", choices=["tiny", "big"], default=["tiny", "big"])
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="raw_te chunk size (%(default)s)")
    ap.add_argument(
        "--tbf-rate",
        default=None,
        metavar="RATE",
        help="also one row: big-shape 512-token pulls between two network namespaces whose "
        "link is capped by tc tbf at RATE (1gbit), against bytes / RATE (root)",
    )
    ap.add_argument("--tbf-only", action="store_true", help="only the --tbf-rate row")
    args = ap.parse_args(argv)
    reps = args.reps or (20 if args.full else 5)
    if args.tokens:
        prompts = {"tiny": args.tokens, "big": args.tokens}
    elif args.full:
        prompts = {"tiny": [128, 256, 512, 1024, 2048], "big": [128, 256, 512, 1024, 2048]}
    else:
        prompts = {"tiny": [128, 512, 2048], "big": [128, 512]}
    shapes = [{"tiny": TINY, "big": BIG}[s] for s in args.shapes]
    id_kinds = ["scattered", "contiguous"]
    chunk_bytes = int(args.chunk_mib * 2**20)
    log_dir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-transfer-"))
    samples = [] if args.tbf_only else run(shapes, prompts, id_kinds, reps, chunk_bytes, log_dir)
    rows = summarize(samples)
    tbf = [tbf_row(BIG, 512, args.tbf_rate, reps, log_dir)] if args.tbf_rate else []
    settings = {
        "mode": "full" if args.full else "quick",
        "reps": reps,
        "prompts": {s.name: prompts[s.name] for s in shapes},
        "shapes": [
            {**asdict(s), "block_bytes": s.block_bytes, "bytes_per_token": s.bytes_per_token}
            for s in shapes
        ],
        "block_ids": id_kinds,
        "layouts": {
            "same": "TP1 -> TP1, same block size: whole blocks",
            "tp-split": f"TP1 -> rank {SPLIT_RANK} of TP{SPLIT_TP}: its heads' slabs",
            "block-resize": "TP1 -> TP1, half the block size: staging, read, scatter_tokens",
        },
        "reblock_buffer_bytes": REBLOCK_BUFFER_BYTES,
        "torch_threads": torch.get_num_threads(),
        "raw_te_chunk_bytes": chunk_bytes,
        "max_batch_entries": MAX_BATCH_ENTRIES,
        "transport": "tcp (MC_FORCE_TCP=1), P2PHANDSHAKE, 127.0.0.2 -> 127.0.0.3",
    }
    if tbf:
        settings["tbf"] = (
            "big shape, 512 tokens, contiguous blocks, same layout; producer and consumer each in "
            f"a network namespace on a bridge (harness.netns), tc tbf {args.tbf_rate} burst 256kb "
            "latency 100ms on the consumer's switch port"
        )
    # A run of the tbf row alone keeps the main table's result.
    name = "transfer-tbf" if args.tbf_only else "transfer"
    paths = common.write_result(
        args.out_dir, name, settings=settings, samples=samples, rows=rows + tbf,
        notes=["GB/s = bytes / median seconds; every pull checked against the producer's bytes",
               "vs_same: the layout's GB/s over same's in the same cell (target >= 0.8)",
               "scatter: block-resize's share of the pull's time in scatter_tokens",
               "raw_te, socket and memcpy move same's bytes: shown on the same rows only"],
        plot=plot(rows) if rows else None,
    )  # fmt: skip
    if rows:
        title = "transfer: KV pull by consumer layout vs raw engine, socket, memcpy"
        common.report(title, rows, [] if tbf else paths)
    if tbf:
        common.report("transfer: a pull across namespaces under a tc tbf cap", tbf, paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
