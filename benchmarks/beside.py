"""What pulls cost the requests a decode is already generating, and the decode's CPU meanwhile.

One host (prefill and decode on 127.0.0.1, as ``benchmarks.soak``). A long request streams from
the decode (its own short prompt, 1200 tokens out). While it streams, the decode is sent ``--pulls``
prompts of ``--tokens`` tokens whose prefill legs ran beforehand, so it only pulls their KV
(16 MB each at 2000 tokens) and computes one token each. The same prompts are then sent without a
handoff (the decode computes them itself), then once more (now in the decode's prefix cache, so
it computes one token each, as after a pull: the control for what is the pull's doing), and the
stream once more alone. Reported per phase:
the stream's inter-token latency (ITL) inside the window where the other requests run, and the
decode server's CPU time (all its processes) per second of that window; for the pull phase also
the pulls' own total time from decode's histogram.

    python -m benchmarks.beside [--out-dir DIR] [--pulls 8] [--tokens 2000]
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks import common
from benchmarks.soak import start
from harness.pd import client_session, complete, sse_events

STREAM_TOKENS = 1200  # long enough to outlast every window
STAGGER_S = 0.05  # between the other requests, so they overlap the stream rather than burst


async def stream_itls(http, decode, model: str, out: list[float], started: asyncio.Event) -> None:
    """Stream one long answer from ``decode``; append each token's arrival time to ``out``."""
    body = {"model": model, "prompt": list(range(10, 74)), "max_tokens": STREAM_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    async with http.post(f"{decode.url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for _event in sse_events(resp):
            out.append(time.monotonic())
            started.set()


async def phase(http, model, decode, bodies: list[dict]) -> dict:
    """The stream, with ``bodies`` sent to the decode while it runs: ITLs and CPU in the window."""
    arrivals: list[float] = []
    started = asyncio.Event()
    stream = asyncio.create_task(stream_itls(http, decode, model, arrivals, started))
    await started.wait()
    await asyncio.sleep(0.3)  # past the stream's first tokens
    cpu0, t0 = decode.process.cpu_s(), time.monotonic()

    async def one(i: int, body: dict) -> None:
        await asyncio.sleep(i * STAGGER_S)
        await complete(http, decode, body)

    if bodies:
        await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    else:
        await asyncio.sleep(1.0)  # the stream alone: a window of comparable length
    t1, cpu1 = time.monotonic(), decode.process.cpu_s()
    # The first token after the window closes its last gap; the rest of the stream is not
    # needed, and dropping it (vLLM aborts the request) keeps each phase as short as its window.
    while not stream.done() and arrivals[-1] <= t1:
        await asyncio.sleep(0.005)
    stream.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await stream
    # Every gap between two tokens that overlaps the window, so a window shorter than one slow
    # step still has that step's gap.
    itls = [1000 * (b - a) for a, b in itertools.pairwise(arrivals) if a < t1 and b > t0]
    return {
        "window_ms": round(1000 * (t1 - t0), 1),
        "itl_n": len(itls),
        "itl_p50_ms": round(common.percentile(itls, 50), 2) if itls else None,
        "itl_p99_ms": round(common.percentile(itls, 99), 2) if itls else None,
        "itl_max_ms": round(max(itls), 2) if itls else None,
        "decode_cpu_cores": round((cpu1 - cpu0) / (t1 - t0), 3),
        "itls_ms": [round(x, 3) for x in itls],
    }


async def measure(model, prefill, decode, pulls: int, tokens: int) -> list[dict]:
    prompts = [[(i * 7919 + j * 31) % 2000 + 3 for j in range(tokens)] for i in range(pulls)]
    rows = []
    async with client_session(600) as http:
        # Warm-up: the first transfer meets the producer, the first long prompt compiles.
        await phase(http, model, decode, [])
        handed = []
        for p in prompts:  # prefill legs first: the decode legs below only pull
            params = {"do_remote_decode": True, "transfer_id": str(uuid.uuid4())}
            head = await complete(http, prefill, {"model": model, "prompt": p, "max_tokens": 1,
                                                  "temperature": 0,
                                                  "kv_transfer_params": params})  # fmt: skip
            handed.append({"model": model, "prompt": p, "max_tokens": 1, "temperature": 0,
                           "kv_transfer_params": head.kv_transfer_params})  # fmt: skip
        pull_sum0 = decode.metric("mooncake_vllm:pull_duration_seconds_sum")
        pulls0 = decode.metric("mooncake_vllm:pulls_total")
        with_pulls = await phase(http, model, decode, handed)
        await asyncio.sleep(2)  # the last step's stats reach /metrics
        pulled = decode.metric("mooncake_vllm:pulls_total") - pulls0
        pull_s = decode.metric("mooncake_vllm:pull_duration_seconds_sum") - pull_sum0
        rows.append({"phase": "beside pulls", "requests": pulls, "pulls": int(pulled),
                     "pull_ms_total": round(1000 * pull_s, 1), **with_pulls})  # fmt: skip
        local = [{k: v for k, v in b.items() if k != "kv_transfer_params"} for b in handed]
        local = [{**b, "prompt": [t + 1 for t in b["prompt"]]} for b in local]  # no cache hits
        rows.append({"phase": "beside local prefills", "requests": pulls, "pulls": 0,
                     "pull_ms_total": 0.0, **await phase(http, model, decode, local)})  # fmt: skip
        rows.append({"phase": "beside cached prompts", "requests": pulls, "pulls": 0,
                     "pull_ms_total": 0.0, **await phase(http, model, decode, local)})  # fmt: skip
        rows.append({"phase": "alone", "requests": 0, "pulls": 0, "pull_ms_total": 0.0,
                     **await phase(http, model, decode, [])})  # fmt: skip
    return rows


def plot(rows: list[dict]):
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        for r in rows:
            ax.plot(r["itls_ms"], marker=".", linewidth=0.8, label=r["phase"])
        ax.set_xlabel("token of the long stream, inside the window")
        ax.set_ylabel("inter-token latency (ms)")
        ax.set_yscale("log")
        ax.legend()
        common.save_figure(fig, path, "a decoding stream beside pulls, local prefills, alone")

    return draw


def record(out_dir: Path, rows: list[dict], settings: dict) -> None:
    """Table, JSON (each phase with its ITLs) and plot."""
    table = [{k: v for k, v in r.items() if k != "itls_ms"} for r in rows]
    settings = {**settings, "stream_tokens": STREAM_TOKENS, "stagger_s": STAGGER_S}
    paths = common.write_result(
        out_dir, "beside", settings=settings, samples=rows, rows=table,
        notes=["one host, TCP, P2P handshake; decode CPU: all processes of the decode server"],
        plot=plot(rows),
    )  # fmt: skip
    common.report("a decoding stream beside pulls", table, paths)


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--pulls", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-bench-beside-"))
    log_dir = workdir / "logs"
    print(f"starting servers (logs in {log_dir})", flush=True)
    model, prefill, decode, proxy, _url = start(workdir, log_dir)
    try:
        rows = asyncio.run(measure(model, prefill, decode, args.pulls, args.tokens))
    finally:
        proxy.stop()
        decode.stop()
        prefill.stop()
    settings = {"pulls": args.pulls, "tokens": args.tokens, "log_dir": str(log_dir)}
    record(args.out_dir, rows, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
