"""Hostile peers against the shared pair (real vLLMs, shared secret on): strangers with nothing
but a ZeroMQ socket, insiders who hold the secret but not the lease, replays, oversized frames, a
flood, and handoffs naming producers the decode does not trust. Each test asserts that the
legitimate requests stay token-exact with every prompt token by transfer, that no pull fails
(the ``pd`` fixture), and that nothing is left held."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import secrets
import statistics
import time
from functools import partial
from pathlib import Path

import msgspec
import pytest
import zmq
from test_connector_e2e import assert_failed_load

from harness.pd import complete, eventually, greedy_body, two_legs
from harness.servers import histogram_quantile
from mooncake_vllm.core.auth import REPLY, load_keys, open_frame
from mooncake_vllm.p2p.leases.client import MAX_READERS
from mooncake_vllm.p2p.protocol import (
    OWNER_BYTES,
    Acquire,
    Granted,
    Refused,
    Release,
    Released,
    decode_frame,
    encode_frame,
)
from mooncake_vllm.p2p.side_channel import seal_request

pytestmark = pytest.mark.servers

MAX_TOKENS = 8
body = partial(greedy_body, max_tokens=MAX_TOKENS)
EXT = {"source": "external_kv_transfer"}


def prompts(seed: int, n: int, lo: int = 130, hi: int = 900) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def side_channel(handoff: dict) -> str:
    return f"{handoff['side_channel_host']}:{handoff['side_channel_ports'][0]}"


class Peer:
    """A DEALER socket to a side channel, sending what it likes (sealed with ``keys`` or not)."""

    def __init__(self, address: str, keys=()):
        self.keys, self.address = keys, address
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{address}")

    def send(self, frame, keys=None) -> tuple[bytes, bytes]:
        """Sends ``frame``; returns the bytes sent and the nonce (to check the reply)."""
        sealed, nonce = seal_request(self.keys if keys is None else keys, frame, self.address)
        self.sock.send(sealed)
        return sealed, nonce

    def answer(self, nonce: bytes, timeout_s: float = 1.0):
        """The reply to the request with ``nonce``, or None if none comes."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return decode_frame(open_frame(self.keys, self.sock.recv(), REPLY, nonce)[0])

    def call(self, frame, timeout_s: float = 1.0):
        return self.answer(self.send(frame)[1], timeout_s)

    def close(self) -> None:
        self.sock.close()


def owner() -> bytes:
    return secrets.token_bytes(OWNER_BYTES)


def rejected(srv) -> float:
    return srv.metric("mooncake_vllm:rejected_frames_total")


async def rejected_reaches(http, pd, at_least: float, timeout_s: float = 20.0) -> float:
    """The prefill's ``rejected_frames`` once it reaches ``at_least``. The lease server reports
    drops every second and the engine core reads them after a step, so each poll steps it."""
    deadline = time.monotonic() + timeout_s
    while (n := rejected(pd.prefill)) < at_least:
        assert time.monotonic() < deadline, f"rejected_frames {n} < {at_least}"
        await asyncio.sleep(1.1)
        await complete(http, pd.prefill, body(pd.model, [5, 6, 7], max_tokens=1))
    return n


async def handoff(http, pd, prompt) -> dict:
    """A finished prefill's handoff, as the proxy would get it."""
    sent_id = f"client-{secrets.token_hex(8)}"
    params = {"do_remote_decode": True, "transfer_id": sent_id}
    head = await complete(
        http, pd.prefill, body(pd.model, prompt, max_tokens=1, kv_transfer_params=params)
    )
    h = head.kv_transfer_params
    # The client's id, as vLLM's upstream connector takes any (bounded) id, and only once.
    assert h["transfer_id"] == sent_id, h
    return h


async def decode_equals_plain(http, pd, prompt, h) -> None:
    ref = await complete(http, pd.plain, body(pd.model, prompt))
    tail = await complete(http, pd.decode, body(pd.model, prompt, kv_transfer_params=h))
    assert tail.token_ids == ref.token_ids


def nothing_held(srv) -> bool:
    return srv.metric("mooncake_vllm:held_leases") == 0


async def test_strangers_and_insiders_cannot_end_or_take_a_lease(pd, http):
    """Forged releases (no secret, a wrong secret, the secret but not the owner's token) and
    bad acquires (empty, wrong or foreign blocks, inflated readers) change nothing: the real
    decode pulls the lease afterwards and answers as plain does."""
    keys = load_keys(str(pd.secret_path), None)
    prompt = prompts(seed=2401, n=1)[0]
    h = await handoff(http, pd, prompt)
    tid, blocks, life = h["transfer_id"], h["remote_block_ids"], h["producer_incarnation"]
    rejected0, pulls0 = rejected(pd.prefill), pd.decode.metric("mooncake_vllm:pulls_total")
    stranger, insider = Peer(side_channel(h)), Peer(side_channel(h), keys)
    wrong_key = (secrets.token_hex(32).encode(),)
    try:
        for frame in (Release(tid, True, owner()), Release(tid, False, owner())):
            assert stranger.call(frame) is None  # unauthenticated: no answer at all
            _, nonce = stranger.send(frame, keys=wrong_key)
            assert stranger.answer(nonce) is None  # a wrong secret: no answer at all
            assert insider.call(frame) is None  # the secret, but never acquired: dropped
        for bad in ([], blocks[:-1], [b + 1 for b in blocks], [*blocks, blocks[0]]):
            reply = insider.call(Acquire(tid, bad, owner(), incarnation=life))
            assert isinstance(reply, Refused) and "not the lease's" in reply.reason, reply
        # More readers than any TP size (MAX_READERS): refused, the lease untouched.
        inflated = MAX_READERS + 1
        reply = insider.call(Acquire(tid, blocks, owner(), readers=inflated, incarnation=life))
        assert isinstance(reply, Refused) and "readers" in reply.reason, reply
        reply = insider.call(Acquire(tid, blocks, owner()))  # no incarnation: another start's
        assert isinstance(reply, Refused) and "producer restarted" in reply.reason, reply
    finally:
        stranger.close()
        insider.close()
    await decode_equals_plain(http, pd, prompt, h)
    assert pd.decode.metric("mooncake_vllm:pulls_total") == pulls0 + 1
    # 2 unauthenticated + 2 wrong-key + 2 non-owner releases.
    await rejected_reaches(http, pd, rejected0 + 6)
    await eventually(lambda: nothing_held(pd.prefill), what="lease released")


async def test_a_replayed_frame_is_dropped_and_the_owner_still_releases(pd, http):
    keys = load_keys(str(pd.secret_path), None)
    h = await handoff(http, pd, prompts(seed=2402, n=1)[0])
    tid, me = h["transfer_id"], owner()
    peer = Peer(side_channel(h), keys)
    try:
        acquire = Acquire(tid, h["remote_block_ids"], me, incarnation=h["producer_incarnation"])
        sealed, nonce = peer.send(acquire)
        assert isinstance(peer.answer(nonce), Granted)
        peer.sock.send(sealed)  # the same bytes again
        assert peer.answer(nonce) is None
        release = Release(tid, True, me)
        sealed, nonce = peer.send(release)
        assert peer.answer(nonce) == Released(tid)
        peer.sock.send(sealed)  # a replayed release is dropped too (it would be harmless)
        assert peer.answer(nonce) is None
    finally:
        peer.close()
    await eventually(lambda: nothing_held(pd.prefill), what="lease released")


async def test_release_flood_by_transfer_id_while_requests_run(pd, http):
    """Every handoff is answered with forged releases before its decode asks for it (the attack
    that failed 29 of 30 requests before ownership): all 30 requests answer as plain does."""
    keys = load_keys(str(pd.secret_path), None)
    batch = prompts(seed=2403, n=30)
    refs = [await complete(http, pd.plain, body(pd.model, p)) for p in batch]
    released0 = pd.prefill.metric("mooncake_vllm:released_total")
    ext0 = pd.decode.metric("vllm:prompt_tokens_by_source_total", **EXT)

    async def one(prompt) -> list[int]:
        ask = body(pd.model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        head = await complete(http, pd.prefill, ask)
        h = head.kv_transfer_params
        for k in ((), keys):
            forger = Peer(side_channel(h), k)
            for ok in (True, False):
                forger.send(Release(h["transfer_id"], ok, owner()))
            forger.close()
        tail = await complete(http, pd.decode, body(pd.model, prompt, kv_transfer_params=h))
        return tail.token_ids

    sem = asyncio.Semaphore(3)

    async def limited(prompt):
        async with sem:
            return await one(prompt)

    got = await asyncio.gather(*(limited(p) for p in batch))
    assert got == [r.token_ids for r in refs]
    ext = pd.decode.metric("vllm:prompt_tokens_by_source_total", **EXT) - ext0
    total = sum(len(p) for p in batch)
    assert total - len(batch) <= ext <= total  # vLLM may compute each prompt's last token
    await eventually(lambda: pd.prefill.metric("mooncake_vllm:released_total") == released0 + 30)


def _flood(address: str, sockets: int, seconds: float, sent) -> None:
    """A child process at the lowest priority (an attacker runs on its own host; here it must
    not take the engines' cores): junk, unknown-id acquires and releases, as fast as it can.
    Each vLLM server runs in a session of its own, so the kernel shares the CPU between
    sessions (autogroups) before it looks at nice values: the flood gets a session whose
    autogroup is at nice 19."""
    os.setsid()
    with contextlib.suppress(OSError):  # no autogroups (CONFIG_SCHED_AUTOGROUP off): nice does
        Path("/proc/self/autogroup").write_text("19")
    os.nice(19)
    ctx = zmq.Context()
    socks = []
    for _ in range(sockets):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.connect(f"tcp://{address}")
        socks.append(s)
    frames = [
        b"\x00junk" * 10,
        encode_frame(Acquire(secrets.token_hex(16), [1, 2, 3], owner(), readers=64)),
        encode_frame(Release(secrets.token_hex(16), True, owner())),
        msgspec.msgpack.encode({"not": "a frame"}),
    ]
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for s in socks:
            try:
                s.send(frames[n % len(frames)], zmq.NOBLOCK)
                n += 1
            except zmq.Again:
                pass
    sent.value = n
    for s in socks:
        s.close()
    ctx.term()


async def _plain_answers(http, pd, batch) -> list:
    return [await complete(http, pd.plain, body(pd.model, p)) for p in batch]


async def _timed_requests(http, pd, batch, refs) -> list[float]:
    """Latencies of two-leg requests at concurrency 2, each checked against plain's answer."""
    sem, out = asyncio.Semaphore(2), []

    async def one(prompt, ref):
        async with sem:
            t0 = time.monotonic()
            _, tail = await two_legs(http, pd.prefill, pd.decode, body(pd.model, prompt))
            out.append(time.monotonic() - t0)
            assert tail.token_ids == ref.token_ids

    await asyncio.gather(*(one(p, r) for p, r in zip(batch, refs, strict=True)))
    return out


ACQUIRE_S = "mooncake_vllm:acquire_duration_seconds"
INF = float("inf")


async def acquires_since(pd, before: dict[float, float], n: int) -> dict[float, float]:
    """The decode's acquire histogram once it holds ``n`` more acquires than ``before`` (one per
    pull; a step's stats reach ``/metrics`` with the engine core's next output)."""
    after: dict[float, float] = {}

    def counted() -> bool:
        nonlocal after
        after = pd.decode.histogram(ACQUIRE_S)
        return after.get(INF, 0.0) - before.get(INF, 0.0) >= n

    await eventually(counted, timeout_s=10, what=f"{n} more acquires on the decode")
    return after


async def test_a_flood_of_junk_costs_real_requests_little(pd, http):
    """Two processes with four sockets each send junk for 10 s while real requests run: all
    answer as plain does, a lease nobody pulls still expires on time, the prefill's log gets a
    line per ten seconds (not one per frame) and ``rejected_frames`` counts the junk. Request
    latency beside the flood (p50) stays within 2x of the same requests without it (the decode's
    acquire p99, whose round trip crosses the flooded lease server, is printed)."""
    quiet_batch, loud_batch = prompts(seed=2405, n=12), prompts(seed=2406, n=12)
    quiet_refs = await _plain_answers(http, pd, quiet_batch)
    loud_refs = await _plain_answers(http, pd, loud_batch)  # before the flood: it covers pulls
    acquires0 = pd.decode.histogram(ACQUIRE_S)
    quiet = await _timed_requests(http, pd, quiet_batch, quiet_refs)
    acquires1 = await acquires_since(pd, acquires0, len(quiet_batch))
    expired0, rejected0 = pd.prefill.metric("mooncake_vllm:expired_total"), rejected(pd.prefill)
    h0 = await handoff(http, pd, prompts(seed=2404, n=1)[0])  # never pulled: it must expire
    issued = time.monotonic()
    address = side_channel(h0)
    # An oversized frame first: ZeroMQ drops the peer; a fresh socket is served afterwards.
    big = Peer(address)
    big.sock.send(b"\x00" * (2 << 20))
    big.close()
    log_size0 = pd.prefill.process.log_path.stat().st_size
    sent = [multiprocessing.Value("q", 0) for _ in range(2)]
    floods = [
        multiprocessing.get_context("fork").Process(target=_flood, args=(address, 4, 10.0, v))
        for v in sent
    ]
    for p in floods:
        p.start()
    t0 = time.monotonic()
    try:
        loud = await _timed_requests(http, pd, loud_batch, loud_refs)
        loud_s = time.monotonic() - t0
    finally:
        for p in floods:
            p.join(timeout=30)
    # The lease issued before the flood expires at its TTL (10 s) all the same.
    await eventually(
        lambda: pd.prefill.metric("mooncake_vllm:expired_total") >= expired0 + 1,
        timeout_s=max(0.5, pd.lease_ttl_s + 3 - (time.monotonic() - issued)),
        what="lease expiry within its TTL + 3 s",
    )
    acquires2 = await acquires_since(pd, acquires1, len(loud_batch))
    frames = sum(v.value for v in sent)
    counted = await rejected_reaches(http, pd, rejected0 + 1000) - rejected0
    log = pd.prefill.process.log_path.read_bytes()[log_size0:].decode(errors="replace")
    lines = [x for x in log.splitlines() if "side-channel frames" in x]
    quiet_p99_s = histogram_quantile(acquires0, acquires1, 0.99)
    loud_p99_s = histogram_quantile(acquires1, acquires2, 0.99)
    print(
        f"\nflood: {frames} frames sent in {time.monotonic() - t0:.1f}s, {counted:.0f} "
        f"counted as rejected, {len(lines)} log lines; requests ran {loud_s:.1f}s of the "
        f"10s flood; latency p50 quiet {statistics.median(quiet):.3f}s, flood "
        f"{statistics.median(loud):.3f}s; max {max(quiet):.3f}s / {max(loud):.3f}s; "
        f"acquire p99 (bucket bound) quiet {1000 * quiet_p99_s:g}ms, flood "
        f"{1000 * loud_p99_s:g}ms"
    )
    # The acquire p99 is printed, not asserted: with 12 acquires it is the slowest one, and one
    # scheduler hiccup on two shared cores moves it two buckets (20 -> 100 ms in one CI run).
    # Timings belong in benchmarks; the median below is what a user sees and is stable.
    # The requests' own latency: the lease server rests between batches of junk
    # (``side_channel.abuse_pause_s``), so the flood cannot take the engines' cores.
    assert statistics.median(loud) <= 2 * statistics.median(quiet), (quiet, loud)
    assert len(lines) <= 4, lines
    assert len(log.encode()) < 100_000  # what a minute of requests logs, not a line per frame
    big_ok = Peer(address, load_keys(str(pd.secret_path), None))
    try:
        reply = big_ok.call(Acquire(secrets.token_hex(16), [1], owner()))
        assert isinstance(reply, Refused)  # served after the oversized frame and the flood
    finally:
        big_ok.close()
    await eventually(lambda: nothing_held(pd.prefill), what="nothing held")


@pytest.mark.provokes_pull_failure
async def test_a_handoff_naming_an_untrusted_producer_is_refused_before_any_frame(pd, http):
    """The kv_both instance trusts the pair's prefill and itself; params naming another host
    fail the request (vLLM's fail policy) and nothing is sent to that host."""
    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind("tcp://127.0.0.13:13004")
    prompt = prompts(seed=2407, n=1, lo=300, hi=300)[0]
    params = {
        "do_remote_prefill": True,
        "transfer_id": secrets.token_hex(16),
        "producer_engine_id": "rogue",
        "side_channel_host": "127.0.0.13",
        "side_channel_ports": [13004],
        "producer_tp_size": 1,
        "remote_block_ids": [1, 2, 3],
        "prompt_len": 300,
        "block_size": 128,
        "compat_hash": "0" * 64,
    }
    failures0 = pd.both.metric("mooncake_vllm:pull_failures_total")
    try:
        request = body(pd.model, prompt, kv_transfer_params=params)
        async with http.post(f"{pd.both.url}/v1/completions", json=request) as resp:
            text = await resp.text()
        assert_failed_load(resp.status, text)
        assert not rogue.poll(500), "a frame reached the untrusted producer"
    finally:
        rogue.close()
    await eventually(lambda: pd.both.metric("mooncake_vllm:pull_failures_total") == failures0 + 1)
    log = pd.both.process.log_path.read_text(errors="replace")
    assert "'127.0.0.13' is not in trusted_producers" in log
