"""The package's layers (``scripts/import_graph.py``): no import runs upward, and the checker
sees one that does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts/import_graph.py")
assert _spec is not None and _spec.loader is not None
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_no_import_runs_upward():
    assert import_graph.violations(import_graph.edges()) == []


def test_the_proxy_imports_neither_transfer_nor_the_connectors():
    imported = set(import_graph.edges()["proxy"])
    assert imported <= {"core", "metadata"}, imported


def test_an_upward_import_is_named_with_its_module(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.py").write_text("def f():\n    from mooncake_vllm.proxy import x\n")
    (tmp_path / "proxy").mkdir()
    (tmp_path / "proxy" / "b.py").write_text("from mooncake_vllm.core import a\n")
    (tmp_path / "odd.py").write_text("import mooncake_vllm.core.a\n")
    graph = import_graph.edges(tmp_path)
    assert import_graph.violations(graph) == [
        "core imports proxy (core/a.py): not below it",
        "odd: in no layer of LAYERS (scripts/import_graph.py)",
    ]
    assert "core --> proxy" in import_graph.mermaid(graph)
