"""Hand check: a burst through ``--dispatch concurrent``, with real servers.

    python -m harness.burst_check [--requests 64] [--tokens 2000] [--load-timeout-s 5]

Starts the README's pair on 127.0.0.1 (vLLM's default ``fail`` policy, the decode's
``load_timeout_s`` shortened so that a queue outlasts it) and three proxies in front of it:
concurrent without the guard (``--concurrent-max-wait-s 1000``), concurrent with it (a third of
``load_timeout_s``) and sequential. Through each, one short request teaches the proxy where the
prefill is, then every prompt is sent at once, as a benchmark client with an unlimited request
rate does. Prints for each proxy: answers and failures, how its decode legs were dispatched and
the decode's pulls and pull failures. Without the guard the decode requests parked on the
prefill's queue run into their load deadline; with it they go sequentially.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from harness.pd import PULL_COUNTERS, client_session, greedy_body, readme_pair, start_many
from harness.tiny_model import build_tiny_model
from harness.xpyd import start_proxy


async def _burst(proxy, decode, model: str, prompts: list[list[int]], warmup: list[int]) -> str:
    async def one(session, prompt) -> int:
        async with session.post(
            proxy.url + "/v1/completions", json=greedy_body(model, prompt, 4)
        ) as r:
            await r.read()
            return r.status

    async with client_session(600.0) as session:
        assert await one(session, warmup) == 200  # teaches the proxy where the prefill is
        before = PULL_COUNTERS.read(decode)
        start = time.monotonic()
        statuses = await asyncio.gather(*(one(session, p) for p in prompts))
        took_s = time.monotonic() - start
        await asyncio.sleep(2.0)  # vLLM publishes a step's counters a moment after its output
    ok = statuses.count(200)
    how = {
        h: proxy.metric("mooncake_proxy_dispatched_total", how=h) for h in ("concurrent", "queued")
    }
    moved = PULL_COUNTERS.since(decode, before)
    return (
        f"{ok} answered, {len(prompts) - ok} failed in {took_s:.1f} s; decode legs sent "
        f"concurrently {how['concurrent']:.0f}, queued (sequentially) {how['queued']:.0f}; "
        f"decode pulls {moved['pulls']:.0f}, pull failures {moved['pull_failures']:.0f}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--load-timeout-s", type=float, default=5.0)
    args = ap.parse_args(argv)
    model = str(build_tiny_model())
    cfg = Path(tempfile.mkdtemp()) / "mooncake.json"
    specs = readme_pair(cfg, "burst", "127.0.0.1", load_timeout_s=args.load_timeout_s)
    prefill, decode = start_many(model, specs)
    backends = ["--prefill", prefill.url, "--decode", decode.url]
    guard = f"{args.load_timeout_s / 3:g}"
    proxies = {
        "concurrent, no guard": ["--dispatch", "concurrent", "--concurrent-max-wait-s", "1000"],
        f"concurrent, --concurrent-max-wait-s {guard}": [
            "--dispatch", "concurrent", "--concurrent-max-wait-s", guard,
        ],
        "sequential": [],
    }  # fmt: skip
    rng = random.Random(0)
    try:
        for name, flags in proxies.items():
            proxy = start_proxy([*backends, *flags])
            try:
                prompts = [
                    [rng.randrange(100, 1000) for _ in range(args.tokens)]
                    for _ in range(args.requests)
                ]
                warmup = [rng.randrange(100, 1000) for _ in range(64)]
                result = asyncio.run(_burst(proxy, decode, model, prompts, warmup))
                print(f"{name}: {args.requests} x {args.tokens} tokens at once: {result}")
            finally:
                proxy.stop()
    finally:
        decode.stop()
        prefill.stop()


if __name__ == "__main__":
    main()
