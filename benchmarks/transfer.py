"""How fast our KV pull moves bytes, against the raw transfer engine, a loopback socket and memcpy.

    python -m benchmarks.transfer [--full] [--out-dir artifacts/bench]

Two processes play the two hosts: a producer (``benchmarks.transfer_peer``, 127.0.0.2) holding
KV-shaped layer buffers registered with a transfer engine, and this process as the consumer
(127.0.0.3), TCP transport, P2P-handshake metadata — the connector's setup on this machine. For
each KV shape and prompt length, the same bytes are moved four ways, interleaved sample by sample:

- ``ours``: what the decode worker does for one pull — ``plan_regions`` over the layer
  segments (``tensor_segments``) for the prompt's blocks, then ``TransferAgent.read``
  (``mooncake_vllm.transfer.engine``: one-entry batches, non-blocking status polls, deadline);
- ``raw_te``: the bare ``mooncake.engine`` object, one ``batch_transfer_sync_read`` of the same
  number of bytes per layer cut in large (``--chunk-mib``) contiguous chunks;
- ``socket``: the producer sends the same number of bytes over a loopback TCP socket;
- ``memcpy``: ``numpy.copyto`` of the same number of bytes within this process.

Block ids are either contiguous (a fresh cache) or scattered (a seeded random choice: the worst case
for region merging). Every pull is checked against the bytes the producer wrote.
"""

from __future__ import annotations

import functools
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks import common
from benchmarks.transfer_peer import allocate, block_byte
from mooncake_vllm.core.planning import plan_regions, tensor_segments
from mooncake_vllm.transfer.engine import TransferAgent

PRODUCER_HOST, CONSUMER_HOST = "127.0.0.2", "127.0.0.3"
METHODS = ["ours", "raw_te", "socket", "memcpy"]
MAX_BATCH_ENTRIES = 512  # the connector's default max_batch_entries
STALL_TIMEOUT_S = 2  # the connector's default stall_timeout_s


@dataclass(frozen=True)
class KvShape:
    """vLLM's CPU layout: one tensor per layer, ``(num_blocks, 2, kv_heads, block_size, head_dim)``
    (K and V inside a block), so one segment per layer."""

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


# The tiny test model (8 KiB/token) and a Llama-3-8B-sized KV (32 layers, 8 KV heads, fp16:
# 128 KiB/token).
TINY = KvShape("tiny", layers=4, kv_heads=4, head_dim=64, dtype_bytes=4)
BIG = KvShape("big", layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)


class Peer:
    """The producer process; its stdin is its lifeline."""

    def __init__(self, shape: KvShape, num_blocks: int, log_dir: Path):
        argv = [
            sys.executable, "-m", "benchmarks.transfer_peer", "--host", PRODUCER_HOST,
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
    """The consumer side for one KV shape: local buffers, peer, socket, the four methods."""

    def __init__(self, engine: TransferAgent, shape: KvShape, num_blocks: int, peer: Peer):
        self.engine, self.shape, self.peer = engine, shape, peer
        self.num_blocks = num_blocks
        self.dst = allocate(shape.layers, num_blocks, shape.block_bytes, fill=False)
        for buf in self.dst:
            engine.register(buf.ctypes.data, buf.nbytes)
        self.local = [self._segments(buf.ctypes.data) for buf in self.dst]
        self.remote = [self._segments(addr) for addr in peer.layer_addrs]
        self.sock = socket.create_connection(peer.socket_addr)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        total = shape.layers * num_blocks * shape.block_bytes
        self.sock_buf = bytearray(total)
        self.copy_src = np.ones(total, dtype=np.uint8)
        self.copy_dst = np.zeros(total, dtype=np.uint8)

    def _segments(self, addr: int):
        s = self.shape
        shape = (self.num_blocks, 2, s.kv_heads, s.block_size, s.head_dim * s.dtype_bytes)
        strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
        return tensor_segments(addr, shape, strides, 1, self.num_blocks)

    def ours(self, src_ids: list[int], dst_ids: list[int]) -> dict:
        t0, c0 = time.perf_counter(), time.thread_time()
        src = [seg for layer in self.remote for seg in layer]
        dst = [seg for layer in self.local for seg in layer]
        regions = plan_regions(src, dst, src_ids, dst_ids)
        result = self.engine.read(
            self.peer.segment,
            regions,
            deadline=time.monotonic() + 60,
            stall_s=STALL_TIMEOUT_S,
            max_in_flight=MAX_BATCH_ENTRIES,
        )
        elapsed = time.perf_counter() - t0
        return {"s": elapsed, "bytes": result.bytes, "entries": result.entries,
                "thread_cpu_s": time.thread_time() - c0}  # fmt: skip

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

    def check(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """Every pulled block holds the producer's byte for its source block (first and last)."""
        for layer, buf in enumerate(self.dst):
            for s, d in zip(src_ids, dst_ids, strict=True):
                want = block_byte(layer, s)
                if buf[d, 0] != want or buf[d, -1] != want:
                    raise AssertionError(f"layer {layer} block {d} (from {s}) holds wrong bytes")

    def close(self) -> None:
        self.sock.close()


def block_ids(n: int, num_blocks: int, layout: str, rng: random.Random) -> tuple[list, list]:
    if layout == "contiguous":
        return list(range(n)), list(range(n))
    return rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)


def run(shapes, prompts, layouts, reps: int, chunk_bytes: int, log_dir: Path, seed: int = 0):
    samples = []
    rng = random.Random(seed)
    engine = TransferAgent(
        CONSUMER_HOST, "P2PHANDSHAKE", "tcp", "",
        env={"MC_FORCE_TCP": "1", "MC_TCP_BIND_ADDRESS": CONSUMER_HOST,
             "MC_TCP_PROGRESS_TIMEOUT_SEC": str(STALL_TIMEOUT_S)},
    )  # fmt: skip
    cases = [(s, p, lay) for s in shapes for p in prompts[s.name] for lay in layouts]
    bar = tqdm(total=len(cases) * reps, desc="transfer samples", file=sys.stderr)
    try:
        for shape in shapes:
            max_blocks = -(-max(prompts[shape.name]) // shape.block_size)
            num_blocks = max(2 * max_blocks, 8)
            peer = Peer(shape, num_blocks, log_dir)
            bench = Bench(engine, shape, num_blocks, peer)
            try:
                for tokens, layout in [(p, lay) for p in prompts[shape.name] for lay in layouts]:
                    n = -(-tokens // shape.block_size)
                    src_ids, dst_ids = block_ids(n, num_blocks, layout, rng)
                    per_layer = n * shape.block_bytes
                    total = per_layer * shape.layers
                    calls = {
                        "ours": functools.partial(bench.ours, src_ids, dst_ids),
                        "raw_te": functools.partial(bench.raw_te, per_layer, chunk_bytes),
                        "socket": functools.partial(bench.socket, total),
                        "memcpy": functools.partial(bench.memcpy, total),
                    }
                    # Warm-up (the first read of a peer handshakes), checking our pull before
                    # raw_te overwrites the destination.
                    calls["ours"]()
                    bench.check(src_ids, dst_ids)
                    for call in calls.values():
                        call()
                    for rep in range(reps):
                        for method, call in calls.items():
                            out = call()
                            samples.append(
                                {
                                    "shape": shape.name, "prompt_tokens": tokens,
                                    "layout": layout, "blocks": n, "method": method, "rep": rep,
                                    **out,
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


def summarize(samples: list[dict]) -> list[dict]:
    keys = sorted({(s["shape"], s["prompt_tokens"], s["layout"]) for s in samples},
                  key=lambda k: (k[0] != "tiny", k[0], k[1], k[2]))  # fmt: skip
    rows = []
    for shape, tokens, layout in keys:
        case = [
            s
            for s in samples
            if (s["shape"], s["prompt_tokens"], s["layout"]) == (shape, tokens, layout)
        ]
        med = {m: common.median([s["s"] for s in case if s["method"] == m]) for m in METHODS}
        nbytes = next(s["bytes"] for s in case if s["method"] == "ours")
        gbps = {m: nbytes / med[m] / 1e9 for m in METHODS}
        entries = next(s["entries"] for s in case if s["method"] == "ours")
        # CPU of the calling thread per second of pull: ~1.0 is a spin, ours sleeps between polls.
        busy = {
            m: common.median([s["thread_cpu_s"] / s["s"] for s in case if s["method"] == m])
            for m in ("ours", "raw_te")
        }
        rows.append(
            {
                "shape": shape, "tokens": tokens, "layout": layout, "MB": nbytes / 1e6,
                "regions": entries, "ours_ms": med["ours"] * 1000,
                **{f"{m}_GB/s": gbps[m] for m in METHODS},
                "ours/raw": gbps["ours"] / gbps["raw_te"],
                "ours/socket": gbps["ours"] / gbps["socket"],
                "ours/memcpy": gbps["ours"] / gbps["memcpy"],
                "ours_cpu": busy["ours"], "raw_cpu": busy["raw_te"],
            }
        )  # fmt: skip
    return rows


def plot(rows: list[dict]):
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
        colors = {"ours": "#1f77b4", "raw_te": "#2ca02c", "socket": "#ff7f0e", "memcpy": "#7f7f7f"}
        for ax, shape in zip(axes[0], shapes, strict=True):
            for layout, style in (("scattered", "-"), ("contiguous", "--")):
                sel = [r for r in rows if r["shape"] == shape and r["layout"] == layout]
                if not sel:
                    continue
                x = [r["tokens"] for r in sel]
                for m in METHODS:
                    if (
                        m != "ours"
                        and layout != "scattered"
                        and any(r["layout"] == "scattered" for r in rows)
                    ):
                        continue  # baselines do not depend on the block layout
                    label = m if m != "ours" else f"ours ({layout} blocks)"
                    ax.plot(
                        x,
                        [r[f"{m}_GB/s"] for r in sel],
                        style,
                        marker="o",
                        color=colors[m],
                        label=label,
                    )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("GB/s (median)")
            ax.set_title(f"KV shape '{shape}'")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        common.save_figure(
            fig, path, "KV pull bandwidth: transfer engine over TCP loopback, 2 processes"
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
    args = ap.parse_args(argv)
    reps = args.reps or (20 if args.full else 5)
    if args.tokens:
        prompts = {"tiny": args.tokens, "big": args.tokens}
    elif args.full:
        prompts = {"tiny": [128, 256, 512, 1024, 2048], "big": [128, 256, 512, 1024, 2048]}
    else:
        prompts = {"tiny": [128, 512, 2048], "big": [128, 512]}
    shapes = [{"tiny": TINY, "big": BIG}[s] for s in args.shapes]
    layouts = ["scattered", "contiguous"]
    chunk_bytes = int(args.chunk_mib * 2**20)
    log_dir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-transfer-"))
    samples = run(shapes, prompts, layouts, reps, chunk_bytes, log_dir)
    rows = summarize(samples)
    settings = {
        "mode": "full" if args.full else "quick",
        "reps": reps,
        "prompts": {s.name: prompts[s.name] for s in shapes},
        "shapes": [
            {**asdict(s), "block_bytes": s.block_bytes, "bytes_per_token": s.bytes_per_token}
            for s in shapes
        ],
        "layouts": layouts,
        "raw_te_chunk_bytes": chunk_bytes,
        "max_batch_entries": MAX_BATCH_ENTRIES,
        "transport": "tcp (MC_FORCE_TCP=1), P2PHANDSHAKE, 127.0.0.2 -> 127.0.0.3",
    }
    paths = common.write_result(
        args.out_dir, "transfer", settings=settings, samples=samples, rows=rows,
        notes=["GB/s = bytes / median seconds; every pull checked against the producer's bytes"],
        plot=plot(rows),
    )  # fmt: skip
    common.report("transfer: KV pull vs raw engine, loopback socket, memcpy", rows, paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
