"""The pure half of the trace soak (``benchmarks/soak_trace.py``): which loop and answer gets
what, how a process is named in the samples, and whether a sampled series stayed flat.

No servers, no vLLM import, no psutil: table-tested in ``tests/test_soak_model.py``.

A sample is one reading of the whole stack, taken every ``--sample-s`` seconds::

    {"t_s": 60.2, "procs": {"decode/EngineCore": {"rss_mib": 812.5, "fds": 96, ...}, ...},
     "engine": {"prefill": {"held_leases": 0}, "decode": {"kv_usage_%": 1.2, ...}}}

``series`` turns a list of them into one time series per (metric, process); ``trend`` fits each.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

# A loop's salt is far from the trace replay's own seeds (``seed`` and ``seed + 1``, its warm-up).
_LOOP_SALT = 1_000_003


def loop_seed(seed: int, loop: int) -> int:
    """The prompt seed of loop ``loop`` (0, 1, ...): loop 0 plays the trace as ``benchmarks.trace``
    does (``seed``); every later loop the same shapes (lengths, shared blocks, turns) with token
    content no earlier loop had, so the prefix cache hits what the trace says it can and no more."""
    if loop < 0:
        raise ValueError(f"loop {loop}: must be 0 or more")
    return seed if loop == 0 else seed + _LOOP_SALT * loop


def checked_against_plain(loop: int, index: int, every: int) -> bool:
    """Whether the answer to request ``index`` (its place in the trace) of loop ``loop`` is also
    asked of the plain vLLM and compared token by token: every one of loop 0, then every
    ``every``-th request of each later loop (shifted by one per loop, so that over ``every`` loops
    each trace request is checked once). ``every`` 0 checks loop 0 only."""
    if every < 0:
        raise ValueError(f"every {every}: must be 0 (loop 0 only) or more")
    if loop == 0:
        return True
    return every > 0 and (index + loop) % every == 0


def process_label(role: str, name: str, cmdline: Sequence[str]) -> str:
    """A short, stable name for one process of ``role``'s process group: vLLM's own titles
    (``VLLM::EngineCore``, ``VLLM::Worker_TP0``) without the prefix, ``python -c`` by the module
    its code imports from (``resource_tracker``), a Python module started with ``-m`` by its last
    part (two for a generic one: ``leases.process``), a script by its stem (``proxy_server``),
    else the process name."""
    if name.startswith("VLLM::"):
        return f"{role}/{name.removeprefix('VLLM::')}"
    args = list(cmdline)
    code = args[args.index("-c") + 1] if "-c" in args[:-1] else ""
    if found := re.search(r"from ([\w.]+) import", code):  # e.g. multiprocessing's tracker
        return f"{role}/{found[1].split('.')[-1]}"
    if "-m" in args[:-1]:
        module = args[args.index("-m") + 1]
        parts = module.split(".")
        tail = (
            parts[-1]
            if parts[-1] not in ("process", "server", "__main__")
            else ".".join(parts[-2:])
        )
        return f"{role}/{tail}"
    scripts = [a for a in args[1:2] if a.endswith(".py")]
    if scripts:
        return f"{role}/{PurePath(scripts[0]).stem}"
    return f"{role}/{name or 'unknown'}"


def unique_labels(labels: Iterable[str]) -> list[str]:
    """``labels`` in order, a repeated one numbered from its second occurrence (``#2``, ...)."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def series(
    samples: Sequence[Mapping[str, Any]],
) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """``{(metric, process): [(t_s, value), ...]}`` over ``samples`` in order; an engine's own
    figures (``engine``, read from its ``/metrics``) under its role (``"prefill"``). A process
    missing from a sample (it had ended, or not started) has no point there; a value of None
    (nothing to say yet, or ``/metrics`` did not answer) is skipped the same way."""
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in samples:
        t = float(s["t_s"])
        for proc, values in (*s.get("procs", {}).items(), *s.get("engine", {}).items()):
            for metric, v in values.items():
                if v is not None:
                    out.setdefault((metric, proc), []).append((t, float(v)))
    return out


@dataclass(frozen=True)
class Trend:
    """A least-squares line through a series' points after its warm-up: ``slope_per_h`` (units of
    the series per hour), ``noise`` (the residuals' standard deviation, same units), and what the
    line moved over the measured span against that noise (``drift``: slope × span)."""

    points: int
    first: float
    last: float
    mean: float
    slope_per_h: float
    noise: float
    span_h: float

    @property
    def drift(self) -> float:
        return self.slope_per_h * self.span_h

    def flat(self, floor: float = 0.0) -> bool:
        """The line moved at most 3 × the noise over the span, or at most ``floor`` (the
        metric's resolution, ``flat_floor``)."""
        return abs(self.drift) <= max(3 * self.noise, floor)


def trend(points: Sequence[tuple[float, float]], warmup_s: float) -> Trend | None:
    """The ``Trend`` of the points at or after ``warmup_s``; None with fewer than three of them
    (two points always lie on a line: no noise to judge it by)."""
    kept = [(t, v) for t, v in points if t >= warmup_s]
    if len(kept) < 3:
        return None
    ts = [t / 3600 for t, _ in kept]
    vs = [v for _, v in kept]
    if max(ts) == min(ts):
        return None
    slope, intercept = statistics.linear_regression(ts, vs)
    residuals = [v - (intercept + slope * t) for t, v in zip(ts, vs, strict=True)]
    # ddof 2: two parameters were fitted from these points.
    noise = math.sqrt(sum(r * r for r in residuals) / (len(kept) - 2))
    return Trend(len(kept), vs[0], vs[-1], statistics.fmean(vs), slope, noise, ts[-1] - ts[0])


# Per metric: its unit, and what ``Trend.flat`` allows beside the noise: for a count, 2 (a
# connection or thread opened once mid-run is a step of one, which a line through the step makes
# a rise of up to 1.5); for memory, 1 % of the series' mean (allocators grow in arenas).
METRICS: dict[str, tuple[str, float, float]] = {
    "rss_mib": ("MiB", 0.0, 0.01),
    "fds": ("count", 2.0, 0.0),
    "threads": ("count", 2.0, 0.0),
    "tcp": ("count", 2.0, 0.0),
    "held_leases": ("count", 2.0, 0.0),
    "kv_usage_%": ("%", 0.0, 0.0),
    "pulls_per_min": ("per min", 0.0, 0.0),
    "pull_failures": ("count", 0.0, 0.0),
}


def flat_floor(metric: str, mean: float) -> float:
    """The rise ``Trend.flat`` lets ``metric`` make whatever its noise (``METRICS``)."""
    _, units, share = METRICS[metric]
    return max(units, share * abs(mean))
