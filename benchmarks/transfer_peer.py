"""The producer side of the transfer benchmark, run as its own process by ``benchmarks.transfer``.

Allocates KV-shaped layer buffers, fills every (layer, block) with known bytes (``block_content``),
registers them with a transfer engine (``mooncake_vllm.transfer.engine``) and serves a loopback TCP
socket that sends N bytes on request (the socket baseline). Prints one JSON line — engine segment,
buffer addresses, socket port — then waits until its stdin closes, and unregisters.
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import struct
import sys
import threading
from collections.abc import Sequence

import numpy as np

from mooncake_vllm.transfer.engine import TransferAgent


def block_byte(layer: int, block: int) -> int:
    """The base byte of ``block`` in ``layer`` on the producer (``block_content``)."""
    return (layer * 31 + block * 7 + 1) % 251


@functools.cache
def _position_bytes(block_bytes: int) -> np.ndarray:
    """A pseudo-random byte per position of a block (splitmix64 of the position), so that a slab or
    a token copied to the wrong place shows."""
    x = np.arange(block_bytes, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))).astype(np.uint8)


def block_content(layer: int, blocks: Sequence[int], block_bytes: int) -> np.ndarray:
    """What ``blocks`` of ``layer`` hold on the producer, ``(len(blocks), block_bytes)`` bytes:
    the position's byte plus the block's base byte (mod 256)."""
    base = np.array([block_byte(layer, b) for b in blocks], dtype=np.uint8)
    return _position_bytes(block_bytes)[None, :] + base[:, None]


def allocate(layers: int, num_blocks: int, block_bytes: int, fill: bool) -> list[np.ndarray]:
    bufs = []
    for layer in range(layers):
        if fill:
            buf = block_content(layer, range(num_blocks), block_bytes)
        else:
            buf = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
        bufs.append(buf)
    return bufs


def serve_socket(sock: socket.socket, payload: memoryview) -> None:
    """Each request is an 8-byte length; the answer is that many bytes of ``payload``."""
    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    break
                (n,) = struct.unpack("!Q", head)
                conn.sendall(payload[:n])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--num-blocks", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, required=True)
    args = ap.parse_args()
    bufs = allocate(args.layers, args.num_blocks, args.block_bytes, fill=True)
    engine = TransferAgent(
        args.host,
        "P2PHANDSHAKE",
        "tcp",
        "",
        env={"MC_FORCE_TCP": "1", "MC_TCP_BIND_ADDRESS": args.host},
    )
    for buf in bufs:
        engine.register(buf.ctypes.data, buf.nbytes)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((args.host, 0))
    sock.listen(4)
    # The socket baseline sends from the (contiguous) first layer buffer, repeated as needed.
    payload = memoryview(np.concatenate([b.reshape(-1) for b in bufs]))
    threading.Thread(target=serve_socket, args=(sock, payload), daemon=True).start()
    print(
        json.dumps(
            {
                "segment": engine.segment_name,
                "layer_addrs": [b.ctypes.data for b in bufs],
                "socket": [args.host, sock.getsockname()[1]],
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # until the benchmark closes our stdin
    engine.close()


if __name__ == "__main__":
    main()
