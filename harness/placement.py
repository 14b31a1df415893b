"""Where the vLLMs of one host run: each engine on its own cores.

vLLM's CPU worker binds its OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND`` (default ``auto``:
every core of the NUMA node). Two engines left at the default on one host both bind every core
and fight over them, and a worker busy-waits for a second after each step on the cores it holds.
``split_cores`` gives each engine a disjoint share of the host's cores instead, and keeps one
back for the proxy, the transfer engine and vLLM's API processes when the host has cores to spare
(at least two per engine plus one).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["bind_env", "cpu_list", "host_cpus", "split_cores"]


def host_cpus() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def cpu_list(cpus: Sequence[int]) -> str:
    """``cpus`` as vLLM's bind syntax: ranges joined by commas (``0-2,5``)."""
    if not cpus:
        raise ValueError("an engine needs at least one core")
    parts: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0]
    for c in [*ordered[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def split_cores(engines: int, cpus: Sequence[int] | None = None) -> list[list[int]]:
    """Disjoint, equal shares of ``cpus`` (default: this host's) for ``engines`` engines, in
    order; the first core is kept back when every engine still gets two."""
    cpus = sorted(host_cpus() if cpus is None else cpus)
    if engines < 1:
        raise ValueError("engines must be at least 1")
    if len(cpus) < engines:
        raise ValueError(
            f"{len(cpus)} cores cannot give {engines} engines one each: run fewer engines on "
            "this host, or leave them unbound (VLLM_CPU_OMP_THREADS_BIND=nobind)"
        )
    spare = cpus[1:] if len(cpus) >= 2 * engines + 1 else cpus
    each = len(spare) // engines
    return [spare[i * each : (i + 1) * each] for i in range(engines)]


def bind_env(cpus: Sequence[int]) -> dict[str, str]:
    """A vLLM server's environment for running on ``cpus`` only."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus), "OMP_NUM_THREADS": str(len(cpus))}
