"""bench/ owns its instruments (issue 54): the package names bench/ only in comments and docstrings that point to a
measurement, and every MHA2GQA_* variable it reads is one the user docs document (none exists for a bench script
alone); the clock's observer seam is what a benchmark builds on."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mha2gqa"


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_no_string_the_package_uses_names_bench():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if "bench/" in node.value:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_every_variable_the_package_reads_is_documented_for_users():
    names = set()
    for path in PACKAGE.rglob("*.py"):
        names |= set(re.findall(r"\bMHA2GQA_[A-Z_]+\b", path.read_text()))
    user_docs = " ".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    undocumented = sorted(name for name in names if name not in user_docs)
    assert names and undocumented == []


def test_a_benchmark_observes_a_run_through_the_clock(monkeypatch):
    from mha2gqa.estimates import clock as clock_module
    from mha2gqa.estimates.clock import command_clock, observe

    monkeypatch.setattr(clock_module, "_OBSERVERS", [])
    assert command_clock(quiet=True) is clock_module.NO_CLOCK  # nobody listens: a quiet run keeps no clock
    records = []
    remove = observe(records.append)
    assert isinstance(command_clock(quiet=True), clock_module.Clock)
    remove()
    assert clock_module._OBSERVERS == []
