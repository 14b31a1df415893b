#!/usr/bin/env python3
"""The KV pull on a GPU, without vLLM: one command, at most 8 minutes.

Two processes each hold a KV cache laid out as vLLM's CUDA attention keeps it, one tensor per
layer of shape ``[2, num_blocks, block_size, kv_heads, head_size]``, registered with the Mooncake
Transfer Engine as device memory (``cuda:N``). The producer fills every byte with a known
pattern; the consumer pulls a scattered set of blocks into other block ids through our transfer
layer (``core.planning`` regions, ``transfer.engine.TransferAgent.read``), checks every byte of
every layer (and that no other block was written), then reads the same regions with the bare
engine (one ``batch_transfer_sync_read``) and prints both rates and their ratio. A JSON summary
goes to ``--out``.

    python scripts/gpu_check.py --wheels DIR          # install the carried wheels, then check
    python scripts/gpu_check.py --device cpu          # the same logic on CPU tensors

``--wheels DIR``: a folder of wheels installed first with ``pip install --no-index`` (the
transfer engine for this CUDA, ``msgspec``, ``pyzmq``: what ``mooncake_vllm.transfer`` needs
beside PyTorch), for a machine that reaches no package index. ``--protocol auto`` (default)
uses RDMA when ``/sys/class/infiniband`` lists a device, else TCP. Exit status 0 only when every
byte matched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUDGET_S = 8 * 60
# Sizes per device: (layers, num_blocks, block_size, kv_heads, head_size, dtype, pulled blocks)
SIZES = {
    "cuda": (8, 1024, 16, 8, 128, "bfloat16", 256),  # 64 MiB a layer, 128 MiB pulled
    "cpu": (4, 64, 16, 4, 64, "float32", 24),  # 2 MiB a layer, 3 MiB pulled
}


def _install(wheels: Path) -> None:
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"--wheels {wheels}: no .whl files there")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    subprocess.run([*cmd, "--no-deps", *found], check=True)


def _pattern(torch, layer: int, nbytes: int, device: str):
    """The producer's bytes of ``layer``: a multiplicative hash of the position and the layer,
    so a block, a K/V plane or a layer copied to the wrong place shows."""
    pos = torch.arange(nbytes, device=device, dtype=torch.int64)
    return ((pos * 2654435761 + layer * 40503 + 17) % 251).to(torch.uint8)


def _kv_caches(torch, cfg: dict, fill: bool) -> list:
    layers, num_blocks, block, heads, head, dtype, _ = cfg["sizes"]
    shape = (2, num_blocks, block, heads, head)
    caches = []
    for layer in range(layers):
        t = torch.zeros(shape, dtype=getattr(torch, dtype), device=cfg["device"])
        if fill:
            flat = t.view(-1).view(torch.uint8)
            flat.copy_(_pattern(torch, layer, flat.numel(), cfg["device"]))
        caches.append(t)
    return caches


def _agent(cfg: dict):
    from mooncake_vllm.transfer.engine import TransferAgent

    env = {"MC_TCP_BIND_ADDRESS": cfg["host"]}
    if cfg["protocol"] == "tcp":
        env["MC_FORCE_TCP"] = "1"
    return TransferAgent(cfg["host"], "P2PHANDSHAKE", cfg["protocol"], cfg["nic"], env=env)


def _location(t) -> str:
    return f"cuda:{t.device.index or 0}" if t.device.type == "cuda" else "*"


def _segments(caches: list) -> list[list[tuple]]:
    import msgspec

    from mooncake_vllm.core.planning import tensor_segments

    return [
        [
            msgspec.structs.astuple(s)
            for s in tensor_segments(
                t.data_ptr(), t.shape, t.stride(), t.element_size(), t.shape[1]
            )
        ]
        for t in caches
    ]


def _producer(conn, cfg: dict) -> None:
    """The prefill's side: fill, register, tell the consumer where, wait until it is done."""
    import torch

    sys.path.insert(0, str(REPO))
    try:
        caches = _kv_caches(torch, cfg, fill=True)
        if cfg["device"] == "cuda":
            torch.cuda.synchronize()
        agent = _agent(cfg)
        for t in caches:
            agent.register(t.data_ptr(), t.numel() * t.element_size(), _location(t))
        conn.send({"segment": agent.segment_name, "segments": _segments(caches)})
        conn.recv()  # the consumer's "done" (or EOF)
        agent.close()
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise
    # The engine's threads can hold an ordinary exit for tens of seconds; nothing is left to do.
    os._exit(0)


def _rates(nbytes: int, samples_s: list[float]) -> dict:
    best = min(samples_s)
    return {
        "samples_s": [round(s, 6) for s in samples_s],
        "median_s": round(statistics.median(samples_s), 6),
        "gbps_median": round(nbytes / statistics.median(samples_s) / 1e9, 3),
        "gbps_best": round(nbytes / best / 1e9, 3),
    }


def run(cfg: dict) -> dict:
    """The check, as the consumer: returns the summary (``ok`` False on any wrong byte)."""
    import torch

    from mooncake_vllm.core.planning import MemSegment, plan_regions

    started = time.monotonic()
    phases = {}
    layers, num_blocks, block, heads, head, dtype, pulled = cfg["sizes"]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    producer = ctx.Process(target=_producer, args=(child, cfg), daemon=True)
    producer.start()
    try:
        if not parent.poll(cfg["deadline"] - time.monotonic()):
            raise TimeoutError("the producer did not start in time")
        peer = parent.recv()
        phases["producer_ready_s"] = round(time.monotonic() - started, 2)
        if "error" in peer:
            raise RuntimeError(f"producer: {peer['error']}")
        caches = _kv_caches(torch, cfg, fill=False)
        agent = _agent(cfg)
        for t in caches:
            agent.register(t.data_ptr(), t.numel() * t.element_size(), _location(t))
        # Scattered on both sides: every other block from the top, into the low ids reversed.
        remote_ids = list(range(num_blocks - 1, -1, -2))[:pulled]
        local_ids = list(range(pulled))[::-1]
        regions = []
        for src, dst in zip(peer["segments"], _segments(caches), strict=True):
            regions += plan_regions(
                [MemSegment(*s) for s in src], [MemSegment(*s) for s in dst], remote_ids, local_ids
            )
        nbytes = sum(r.length for r in regions)
        deadline = lambda: time.monotonic() + cfg["read_timeout_s"]  # noqa: E731
        agent.warm_up(peer["segment"], regions[0].src_addr, deadline=deadline(), stall_s=30)

        ours, raw = [], []
        for i in range(cfg["repeats"]):
            t0 = time.perf_counter()
            agent.read(peer["segment"], regions, deadline=deadline(), stall_s=30, max_in_flight=64)
            ours.append(time.perf_counter() - t0)
            if i == 0:
                mismatched, stray = _verify(torch, cfg, caches, remote_ids, local_ids)
        te = agent._te  # the bare engine: the baseline our wrapper is measured against
        dsts, srcs, lens = (
            [getattr(r, f) for r in regions] for f in ("dst_addr", "src_addr", "length")
        )
        for _ in range(cfg["repeats"]):
            t0 = time.perf_counter()
            rc = te.batch_transfer_sync_read(peer["segment"], dsts, srcs, lens)
            raw.append(time.perf_counter() - t0)
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_read returned {rc}")
        parent.send("done")
        phases["reads_done_s"] = round(time.monotonic() - started, 2)
        agent.close()
    finally:
        producer.join(timeout=30)
        if producer.is_alive():
            producer.kill()
    phases["producer_gone_s"] = round(time.monotonic() - started, 2)
    ours_r, raw_r = _rates(nbytes, ours), _rates(nbytes, raw)
    return {
        "ok": mismatched == 0 and stray == 0,
        "mismatched_bytes": mismatched,
        "stray_bytes": stray,
        "device": cfg["device_name"],
        "protocol": cfg["protocol"],
        "nic": cfg["nic"],
        "layout": {
            "shape_per_layer": [2, num_blocks, block, heads, head],
            "dtype": dtype,
            "layers": layers,
            "pulled_blocks": pulled,
        },
        "bytes": nbytes,
        "regions": len(regions),
        "ours": ours_r,
        "raw_engine": raw_r,
        "ratio_to_raw": round(raw_r["median_s"] / ours_r["median_s"], 3),
        "phases": phases,
        "elapsed_s": round(time.monotonic() - started, 2),
    }


def _verify(torch, cfg: dict, caches: list, remote_ids: list[int], local_ids: list[int]):
    """Wrong bytes in the pulled blocks, and bytes written anywhere else (both must be 0)."""
    if cfg["device"] == "cuda":
        torch.cuda.synchronize()
    src = torch.tensor(remote_ids, device=cfg["device"])
    dst = torch.tensor(local_ids, device=cfg["device"])
    others = torch.ones(caches[0].shape[1], dtype=torch.bool, device=cfg["device"])
    others[dst] = False
    mismatched = stray = 0
    for layer, t in enumerate(caches):
        got = t.view(-1).view(torch.uint8).view(*t.shape[:-1], -1)
        want = _pattern(torch, layer, got.numel(), cfg["device"]).view(got.shape)
        mismatched += int((got[:, dst] != want[:, src]).sum())
        stray += int((got[:, others] != 0).sum())
    return mismatched, stray


def _protocol(asked: str) -> tuple[str, str]:
    ib = Path("/sys/class/infiniband")
    nics = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    if asked == "rdma" and not nics:
        raise SystemExit("--protocol rdma: /sys/class/infiniband lists no device")
    if asked == "rdma" or (asked == "auto" and nics):
        return "rdma", nics[0]
    return "tcp", ""


def _versions() -> dict:
    import importlib.metadata as md

    found = {}
    for dist in ("torch", "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13",
                 "mooncake-transfer-engine-non-cuda"):  # fmt: skip
        with contextlib.suppress(md.PackageNotFoundError):
            found[dist] = md.version(dist)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--wheels", type=Path, help="install these wheels first (no index)")
    ap.add_argument("--protocol", choices=["auto", "tcp", "rdma"], default="auto")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = ap.parse_args(argv)
    started = time.monotonic()
    if args.wheels:
        _install(args.wheels)
    sys.path.insert(0, str(REPO))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to PyTorch: run with --device cpu", file=sys.stderr)
        return 2
    protocol, nic = _protocol(args.protocol)
    cfg = {
        "device": args.device,
        "device_name": (
            torch.cuda.get_device_name(0)
            if args.device == "cuda"
            else f"CPU ({os.cpu_count()} cores)"
        ),
        "sizes": SIZES[args.device],
        "protocol": protocol,
        "nic": nic,
        "host": args.host,
        "repeats": args.repeats,
        "read_timeout_s": 60.0,
        "deadline": started + BUDGET_S,
    }
    summary = run(cfg)
    summary["versions"] = _versions()
    summary["python"] = platform.python_version()
    summary["host"] = platform.node()
    summary["utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    o, r = summary["ours"], summary["raw_engine"]
    print(
        f"{summary['device']} over {protocol}: {summary['bytes'] / 2**20:.0f} MiB in "
        f"{summary['regions']} regions; ours {o['gbps_median']} GB/s, raw engine "
        f"{r['gbps_median']} GB/s (ratio {summary['ratio_to_raw']}); "
        f"wrong bytes {summary['mismatched_bytes']}, stray bytes {summary['stray_bytes']}; "
        f"{summary['elapsed_s']} s -> {args.out}"
    )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # not a plain exit: the engine's threads can hold that for tens of seconds
