"""The pure half of the trace replay: a Mooncake trace read, cut to whole conversations, scaled to
this box, turned into token-id prompts, and judged (the reuse bound, SLO attainment, goodput).

No servers, no vLLM import: everything here is table-tested in ``tests/test_trace_model.py``;
``benchmarks/trace.py`` does the I/O.

A trace line (kvcache-ai/Mooncake ``FAST25-release/traces/*.jsonl``) is one request: arrival
``timestamp`` in ms, ``input_length`` and ``output_length`` in tokens, and ``hash_ids``, one per
512-token block of the prompt (the last one partial): equal ids mean equal blocks, so a prefix of
equal ids is a prefix any cache could reuse.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import percentile

TRACE_BLOCK_TOKENS = 512  # the published traces' hash block


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        blocks = math.ceil(self.input_length / TRACE_BLOCK_TOKENS)
        if len(self.hash_ids) != blocks:
            raise ValueError(
                f"input_length {self.input_length} needs {blocks} hash_ids of "
                f"{TRACE_BLOCK_TOKENS} tokens, got {len(self.hash_ids)}"
            )

    def to_json(self) -> dict[str, Any]:
        return {"timestamp": self.timestamp_ms, "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids)}  # fmt: skip


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """One request per non-empty JSON line, in file order; a bad line raises naming its number."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(TraceRequest(int(d["timestamp"]), int(d["input_length"]),
                                    int(d["output_length"]), tuple(d["hash_ids"])))  # fmt: skip
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"trace line {n}: {e}") from e
    return out


def load_trace(path: Path) -> list[TraceRequest]:
    with path.open() as f:
        return parse_trace(f)


def conversations(requests: Sequence[TraceRequest], key_blocks: int = 2) -> list[list[int]]:
    """Indices of ``requests`` grouped into conversations, each in arrival order, the groups in
    order of their first request.

    Two requests are one conversation when their first ``key_blocks`` hash ids are equal. In the
    conversation trace every request starts with the same block (id 0: a shared system prompt), so
    the second block is what tells conversations apart; a later turn resends its history, so it
    keeps both.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.hash_ids[:key_blocks], []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def pick_slice(
    requests: Sequence[TraceRequest],
    max_requests: int,
    max_input_length: int,
    min_turns: int = 2,
    key_blocks: int = 2,
) -> list[TraceRequest]:
    """Whole conversations, earliest first, until ``max_requests``: each with at least
    ``min_turns`` requests and none longer than ``max_input_length``. A conversation that would
    overflow ``max_requests`` is skipped, never cut (its later turns reuse its earlier ones)."""
    picked: list[int] = []
    for group in conversations(requests, key_blocks):
        if len(group) < min_turns or len(picked) + len(group) > max_requests:
            continue
        if any(requests[i].input_length > max_input_length for i in group):
            continue
        picked += group
        if len(picked) == max_requests:
            break
    return [requests[i] for i in sorted(picked)]


@dataclass(frozen=True)
class Scale:
    """How a trace is fitted to this box: token lengths divided by ``length_div`` (so a 512-token
    hash block becomes ``512 / length_div`` tokens), time multiplied by ``time_mul``, outputs
    capped at ``max_output_tokens`` after the division."""

    length_div: int
    time_mul: float
    max_output_tokens: int

    def __post_init__(self) -> None:
        if self.length_div < 1 or TRACE_BLOCK_TOKENS % self.length_div:
            raise ValueError(f"length_div {self.length_div}: must divide {TRACE_BLOCK_TOKENS}")
        if self.time_mul <= 0 or self.max_output_tokens < 1:
            raise ValueError(f"time_mul {self.time_mul} and max_output_tokens "
                             f"{self.max_output_tokens} must be positive")  # fmt: skip

    @property
    def block_tokens(self) -> int:
        return TRACE_BLOCK_TOKENS // self.length_div

    def input_tokens(self, r: TraceRequest) -> int:
        return math.ceil(r.input_length / self.length_div)

    def output_tokens(self, r: TraceRequest) -> int:
        return max(1, min(self.max_output_tokens, round(r.output_length / self.length_div)))

    def arrival_s(self, r: TraceRequest, first_ms: int) -> float:
        return (r.timestamp_ms - first_ms) / 1000 * self.time_mul


def block_tokens_for(hash_id: int, block_tokens: int, vocab: int, seed: int = 0) -> list[int]:
    """The token ids standing for trace block ``hash_id``: the same for the same id, whatever the
    request, and (with overwhelming odds) different for different ids. Ids 0..2 are left out
    (the tiny model's special tokens)."""
    rng = random.Random(
        f"{seed}:{hash_id}"
    )  # str seeds hash deterministically (not PYTHONHASHSEED)
    return [rng.randrange(3, vocab) for _ in range(block_tokens)]


def prompt_for(r: TraceRequest, scale: Scale, vocab: int, seed: int = 0) -> list[int]:
    """``r``'s prompt: its blocks' token ids in order, cut to its scaled input length (the last
    block partial, as in the trace)."""
    ids: list[int] = []
    for h in r.hash_ids:
        ids += block_tokens_for(h, scale.block_tokens, vocab, seed)
    return ids[: scale.input_tokens(r)]


def new_tokens(requests: Sequence[TraceRequest], scale: Scale) -> list[int]:
    """Per request (in the given order), its scaled prompt tokens in blocks no earlier request
    covered: the least any system must compute for it, with a cache that forgets nothing. A block
    seen before only partly (an earlier prompt ended inside it) counts the tokens beyond that."""
    covered: dict[int, int] = {}  # hash id -> tokens of it some earlier prompt held
    out = []
    for r in requests:
        n_tokens = scale.input_tokens(r)
        fresh = 0
        for i, h in enumerate(r.hash_ids):
            in_block = min(scale.block_tokens, n_tokens - i * scale.block_tokens)
            if in_block <= 0:
                break
            fresh += max(0, in_block - covered.get(h, 0))
            covered[h] = max(covered.get(h, 0), in_block)
        out.append(fresh)
    return out


@dataclass(frozen=True)
class Slo:
    """A request attains the SLO when its TTFT is at most ``ttft_ms`` and its TBT (the
    ``tbt_quantile`` of its gaps between streamed tokens) at most ``tbt_ms``."""

    ttft_ms: float
    tbt_ms: float
    tbt_quantile: float = 90.0


def request_tbt_ms(token_times_s: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of the gaps between a request's streamed tokens (ms); None for fewer
    than two tokens (nothing to judge: a one-token answer meets any TBT SLO)."""
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(token_times_s)]
    return percentile(gaps, q) if gaps else None


def attainment(samples: Sequence[dict[str, Any]], slo: Slo, span_s: float) -> dict[str, float]:
    """The paper's measures over ``samples`` (each with ``ttft_ms`` and ``tbt_ms`` (None: one
    token) or ``error``): the share meeting the TTFT SLO, the TBT SLO and both, and goodput,
    the requests meeting both per second of the replay's ``span_s``. A failed request meets
    nothing."""
    n = len(samples)
    ok = [s for s in samples if "error" not in s]
    ttft_ok = [s for s in ok if s["ttft_ms"] <= slo.ttft_ms]
    tbt_ok = [s for s in ok if s["tbt_ms"] is None or s["tbt_ms"] <= slo.tbt_ms]
    both = [s for s in ttft_ok if s["tbt_ms"] is None or s["tbt_ms"] <= slo.tbt_ms]
    return {
        "ttft_slo_%": 100 * len(ttft_ok) / n if n else float("nan"),
        "tbt_slo_%": 100 * len(tbt_ok) / n if n else float("nan"),
        "both_slo_%": 100 * len(both) / n if n else float("nan"),
        "goodput_rps": len(both) / span_s if span_s > 0 else float("nan"),
    }


def routing_regret(
    requests: Sequence[TraceRequest], engines: Sequence[str | None], scale: Scale
) -> list[int]:
    """Per request (in the order sent), the prompt tokens some other engine of the pool held
    beyond what its chosen engine (``engines``, one per request; None: not known) held: the
    recompute (prefill pool) or the pull (decode pool) its routing added.

    An engine is taken to hold every full block of every prompt sent to it earlier (no
    eviction); a request reuses the leading run of its full blocks that its engine holds, at
    most ``(len - 1) // block`` of them (vLLM computes a prompt's last token). 0 when the chosen
    engine held the most, or the request's engine is not known."""
    held: dict[str, set[int]] = {}
    out = []
    for r, engine in zip(requests, engines, strict=True):
        n_tokens = scale.input_tokens(r)
        full = r.hash_ids[: n_tokens // scale.block_tokens]
        reusable = full[: (n_tokens - 1) // scale.block_tokens]

        def run(blocks: set[int], reusable: tuple[int, ...] = reusable) -> int:
            return next((i for i, h in enumerate(reusable) if h not in blocks), len(reusable))

        if engine is None:
            out.append(0)
            continue
        best = max((run(blocks) for blocks in held.values()), default=0)
        out.append((best - run(held.get(engine, set()))) * scale.block_tokens)
        held.setdefault(engine, set()).update(full)
    return out
