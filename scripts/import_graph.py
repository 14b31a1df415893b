"""The package's import graph, by subpackage, checked against its layers.

    python scripts/import_graph.py            # the graph as mermaid (docs/architecture.md)
    python scripts/import_graph.py --check    # exit 1 naming every import that runs upward

Every ``import``/``from ... import`` of ``mooncake_vllm`` in every module counts, those inside a
function too (a deferred import is still a dependency). A subpackage (or top-level module) may
import only from a lower layer of ``LAYERS``; two on one layer do not import each other.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mooncake_vllm"
# Lowest first. metadata and vllm_glue import nothing of ours; the proxy sits beside transfer,
# so it cannot import it (it needs only metadata's targets, auth and redaction).
LAYERS: list[set[str]] = [
    {"metadata", "vllm_glue"},
    {"plugin"},
    {"core"},
    {"transfer", "proxy"},
    {"p2p"},
    {"pool"},
    {"connector"},
]


def unit_of(parts: tuple[str, ...]) -> str:
    """``("proxy", "app.py")`` -> ``proxy``; ``("plugin.py",)`` -> ``plugin``."""
    return parts[0].removesuffix(".py")


def edges(package: Path = PACKAGE) -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the modules (paths under the package) that import it."""
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        src = unit_of(rel.parts)
        if src == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
                if node.module == "mooncake_vllm":
                    names = [f"mooncake_vllm.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != "mooncake_vllm" or len(parts) < 2 or parts[1] == src:
                    continue
                out[src][parts[1]].add(str(rel))
    return out


def violations(graph: dict[str, dict[str, set[str]]], layers: list[set[str]] = LAYERS) -> list[str]:
    """One line per import that runs upward or sideways, or from a unit no layer names."""
    layer = {unit: i for i, units in enumerate(layers) for unit in units}
    bad = []
    for src, targets in sorted(graph.items()):
        for dst, modules in sorted(targets.items()):
            if src not in layer or dst not in layer:
                missing = src if src not in layer else dst
                bad.append(f"{missing}: in no layer of LAYERS (scripts/import_graph.py)")
            elif layer[dst] >= layer[src]:
                bad.append(f"{src} imports {dst} ({', '.join(sorted(modules))}): not below it")
    return bad


def mermaid(graph: dict[str, dict[str, set[str]]]) -> str:
    lines = ["graph BT"]
    for src, targets in sorted(graph.items()):
        lines += [f"    {src} --> {dst}" for dst in sorted(targets)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail on an import that runs upward")
    args = parser.parse_args(argv)
    graph = edges()
    if args.check:
        bad = violations(graph)
        for line in bad:
            print(line, file=sys.stderr)
        return 1 if bad else 0
    print(mermaid(graph))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
