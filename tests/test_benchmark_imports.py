"""The benchmarks import their helpers inside functions (the worker loops run in Ray's processes):
a helper moved to another module breaks a benchmark only when it runs, minutes into a run. Every
``from benchmarks.X import name`` of every benchmark, at any depth, names something module X has."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "benchmarks").rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_from_a_benchmark_module_names_what_that_module_has(path):
    missing = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("benchmarks"):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:  # a submodule of a package
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"line {node.lineno}: {node.module}.{alias.name}")
    assert not missing, f"{path.relative_to(ROOT)} imports names its modules do not have: {missing}"
