"""A prefill/decode pair of real vLLM servers wired with MooncakeConnector, and a two-leg client.

Shared by the tests, the demo and the benchmarks. The pair plays two hosts on one machine:
prefill on 127.0.0.2, decode on 127.0.0.3, TCP transport, P2P-handshake metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from harness.servers import MasterServer, VllmServer, start_vllm

PREFILL_HOST, DECODE_HOST = "127.0.0.2", "127.0.0.3"


def mooncake_json(path: Path, **overrides: Any) -> Path:
    """Write a Mooncake-format config (one file for both sides) and return its path."""
    cfg = {
        "prefill_url": f"{PREFILL_HOST}:13003",
        "decode_url": f"{DECODE_HOST}:13012",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "device_name": "",
        **overrides,
    }
    path.write_text(json.dumps(cfg, indent=2))
    return path


def kv_args(role: str, extra: Mapping[str, Any] | None = None, **top: Any) -> list[str]:
    """``--kv-transfer-config`` selecting our connector by the name the plugin registers."""
    cfg: dict[str, Any] = {"kv_connector": "MooncakeConnector", "kv_role": role, **top}
    if extra:
        cfg["kv_connector_extra_config"] = dict(extra)
    return ["--kv-transfer-config", json.dumps(cfg)]


def pool_args(role: str, extra: Mapping[str, Any], **top: Any) -> list[str]:
    """vLLM's ``--kv-transfer-config`` for our ``MooncakeStoreConnector`` (pool mode)."""
    cfg: dict[str, Any] = {"kv_connector": "MooncakeStoreConnector", "kv_role": role, **top}
    cfg["kv_connector_extra_config"] = dict(extra)
    return ["--kv-transfer-config", json.dumps(cfg)]


def pool_extra(master: MasterServer, **settings: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` of a pool on ``master`` (its http metadata server), plus
    ``settings``."""
    return {
        "master_server_address": master.address,
        "metadata_server": master.metadata_url,
        **settings,
    }


@dataclass(frozen=True)
class ServerSpec:
    name: str
    host: str = "127.0.0.1"
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None  # another model than ``start_many``'s
    cwd: Path | None = None  # where ``python -m`` starts: its first sys.path entry
    cli: bool = False  # start it as ``vllm serve MODEL ...`` (see ``start_vllm``)
    max_model_len: int = 2048
    port: int | None = None  # None: one free on ``host`` (the caller's network namespace)
    prefix: Sequence[str] = ()  # e.g. ``ip netns exec NS`` (see ``start_vllm``)


# A reference: a plain vLLM that only answers what a pair must equal, never timed. Its worker runs
# inside the engine core (vLLM's uni executor, which the CPU platform keeps only with
# VLLM_ENABLE_V1_MULTIPROCESSING=0; the API server still runs the engine core in its own
# process): one process fewer to start, and no worker spinning on vLLM's shared-memory queue for
# a second after every step. Same kernels, one OpenMP thread (``vllm_env``): the same tokens.
REFERENCE_ARGS = ("--distributed-executor-backend", "uni")
REFERENCE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def reference_spec(name: str, host: str = "127.0.0.1", args: Sequence[str] = ()) -> ServerSpec:
    """A plain vLLM to compare with (``REFERENCE_ARGS``); not for timing: benchmarks compare
    against vLLM as users run it."""
    return ServerSpec(name, host, [*args, *REFERENCE_ARGS], dict(REFERENCE_ENV))


def readme_pair(
    cfg_path: Path,
    tag: str,
    host: str,
    *,
    env: Mapping[str, str] | None = None,
    prefill_env: Mapping[str, str] | None = None,
    cli: bool = False,
    **config: Any,
) -> list[ServerSpec]:
    """The README's minimal pair on ``host``: one mooncake.json at ``cfg_path`` (P2P handshake
    over TCP, ``config`` added) read by a ``kv_producer`` and a ``kv_consumer`` under vLLM's
    default failure policy, named ``prefill-<tag>`` and ``decode-<tag>``."""
    mooncake_json(cfg_path, **config)
    common = {"MOONCAKE_CONFIG_PATH": str(cfg_path), **(env or {})}
    prefill = {**common, **(prefill_env or {})}
    return [
        ServerSpec(f"prefill-{tag}", host, kv_args("kv_producer"), prefill, cli=cli),
        ServerSpec(f"decode-{tag}", host, kv_args("kv_consumer"), common, cli=cli),
    ]


def start_many(
    model: str,
    specs: Sequence[ServerSpec],
    timeout_s: float = 900.0,
    log_dir: Path | None = None,
):
    """Start servers concurrently (vLLM start is mostly single-threaded imports); all or none."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [
            pool.submit(
                start_vllm,
                s.model or model,
                name=s.name,
                host=s.host,
                args=s.args,
                env=s.env,
                timeout_s=timeout_s,
                log_dir=log_dir,
                cwd=s.cwd,
                cli=s.cli,
                max_model_len=s.max_model_len,
                port=s.port,
                prefix=s.prefix,
            )
            for s in specs
        ]
        started, error = [], None
        for f in futures:
            try:
                started.append(f.result())
            except Exception as e:  # re-raised below, after cleanup
                error = error or e
    if error is not None:
        for srv in started:
            srv.stop()
        raise error
    return started


def stop_servers(started: Sequence[Any], print_logs: bool) -> None:
    """Stop servers last-started first, printing each one's log tail first when
    ``print_logs`` (a module's tests failed)."""
    for srv in reversed(started):
        if print_logs:
            proc = srv.process
            print(f"\n===== log of {proc.name} ({proc.log_path}) =====\n{proc.log_tail()}")
        srv.stop()


def start_with_master(model: str, master: MasterServer, specs: Sequence[ServerSpec]):
    """``start_many`` for a pool's servers: if they do not all start, the master stops too."""
    try:
        return start_many(model, specs)
    except Exception:
        master.stop()
        raise


# ---- two-leg client -----------------------------------------------------------------------------


def client_session(total_timeout_s: float = 300.0) -> aiohttp.ClientSession:
    """An HTTP client for vLLM servers. Idle connections are dropped after 2 s, before vLLM's
    5 s keep-alive closes them from its side (reusing one it just closed fails the request)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(keepalive_timeout=2.0),
        timeout=aiohttp.ClientTimeout(total=total_timeout_s),
    )


def greedy_body(model: str, prompt, max_tokens: int, **kw: Any) -> dict[str, Any]:
    """A /v1/completions body that decodes greedily (``temperature`` 0), plus ``kw``."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None = None


async def complete(
    session: aiohttp.ClientSession, server: VllmServer | str, body: dict[str, Any]
) -> Answer:
    """One /v1/completions call (streamed when ``body["stream"]``), with token ids collected."""
    url = server if isinstance(server, str) else server.url
    body = {"return_token_ids": True, **body}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        if not body.get("stream"):
            data = await resp.json()
            choice = data["choices"][0]
            return Answer(
                choice["text"], list(choice.get("token_ids") or []), choice["finish_reason"],
                data.get("kv_transfer_params"),
            )  # fmt: skip
        text, ids, finish = [], [], None
        async for event in sse_events(resp):
            for choice in event.get("choices", []):
                text.append(choice.get("text") or "")
                ids.extend(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
        return Answer("".join(text), ids, finish)


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style SSE stream, up to ``[DONE]``; an error event raises."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            raise RuntimeError(f"{resp.url}: stream error {event['error']}")
        yield event


async def two_legs(
    session: aiohttp.ClientSession,
    prefill: VllmServer | str,
    decode: VllmServer | str,
    body: dict[str, Any],
    prefill_extra: Mapping[str, Any] | None = None,
) -> tuple[Answer, Answer]:
    """Prefill with ``max_tokens=1`` and ``do_remote_decode``, then decode with its handoff."""
    first = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": str(uuid.uuid4())},
        **(prefill_extra or {}),
    }
    head = await complete(session, prefill, first)
    if head.kv_transfer_params is None:
        raise RuntimeError("prefill returned no kv_transfer_params")
    tail = await complete(session, decode, {**body, "kv_transfer_params": head.kv_transfer_params})
    return head, tail


# ---- counters, read as differences ------------------------------------------------------------
# A counter counts since its server started, and a server serves many tests: a test asserts how far
# a counter moved around its own requests (``read`` before, ``since`` after), never its value.


@dataclass(frozen=True)
class Counters:
    """A set of our counters, ``vllm:mooncake_<prefix><name>_total``, by short name (the
    ``mooncake_vllm:`` alias is read by tests that name it)."""

    prefix: str
    names: tuple[str, ...]

    def read(self, server: VllmServer) -> dict[str, float]:
        """Each counter's value on ``server`` now (0 for one not counted yet)."""
        names = {n: f"vllm:mooncake_{self.prefix}{n}_total" for n in self.names}
        totals = server.metrics(names.values())
        return {n: totals.get(name, 0.0) for n, name in names.items()}

    def since(self, server: VllmServer, before: Mapping[str, float]) -> dict[str, float]:
        """How far each counter on ``server`` has moved since ``before`` (a ``read`` of it)."""
        return {n: v - before[n] for n, v in self.read(server).items()}


# The P2P connector's pulls on a consumer.
PULL_COUNTERS = Counters("", ("pulls", "pull_failures", "blocks", "bytes", "retries", "stalls"))
# The pool connector's lookups, puts and gets.
POOL_COUNTERS = Counters(
    "pool_",
    (
        "lookups",
        "hit_blocks",
        "miss_blocks",
        "loads",
        "get_blocks",
        "get_bytes",
        "load_failures",
        "put_blocks",
        "put_skipped_blocks",
        "put_bytes",
        "put_failures",
    ),
)


async def pulls_since(
    server: VllmServer, before: Mapping[str, float], pulls: int, timeout_s: float = 10.0
) -> dict[str, float]:
    """``PULL_COUNTERS.since(server, before)`` once ``pulls`` more pulls have ended, either way
    (vLLM publishes a step's counters a moment after its output); AssertionError at the deadline."""

    def ended() -> bool:
        moved = PULL_COUNTERS.since(server, before)
        return moved["pulls"] + moved["pull_failures"] >= pulls

    await eventually(ended, timeout_s, f"{pulls} pulls counted")
    return PULL_COUNTERS.since(server, before)


def tokens_by_transfer(server: VllmServer) -> float:
    """Prompt tokens vLLM counted as loaded by a connector on ``server`` since it started
    (``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``)."""
    return server.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


async def minimal_proxy(
    session: aiohttp.ClientSession, prefill: VllmServer, decode: VllmServer, body: dict[str, Any]
) -> Answer:
    """What the minimal proxy of Mooncake's vLLM guide does: the request to prefill with
    ``max_tokens=1``, then the original request to decode; nothing passed between them."""
    await complete(session, prefill, {**body, "max_tokens": 1, "stream": False})
    return await complete(session, decode, body)


async def eventually(check, timeout_s: float = 15.0, what: str = "condition") -> float:
    """Poll ``check()`` every 50 ms until it is true; the seconds it took, or AssertionError."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not reached within {timeout_s:g}s"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def settles_at(read, expected: float, what: str) -> None:
    """``read()`` reaches ``expected`` (vLLM publishes a step's counters with its output, the
    API process records them a moment later); the failure shows the value it stayed at."""
    with contextlib.suppress(AssertionError):
        await eventually(lambda: read() == expected, what=what)
    assert read() == expected, f"{what}: {read()}, not {expected}"
