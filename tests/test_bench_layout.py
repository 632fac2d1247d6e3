"""bench/ holds runners only: every script is in bench/README.md's table with the test that runs it, results and
recipes live in bench/results/ and recipes/bench/, and no script of bench/ or scripts/ reaches into the package's
private names (a leading underscore), which may change without notice."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _rows() -> dict[str, str]:
    """bench/README.md's table: {script: its last cell (the test that runs it)}."""
    rows = {}
    for line in (BENCH / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        script = re.fullmatch(r"`(\w+\.py)`", cells[0]) if len(cells) > 1 else None
        if script:
            rows[script.group(1)] = cells[-1]
    return rows


def test_every_bench_script_has_a_row_naming_the_test_that_runs_it():
    rows = _rows()
    runners = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
    assert sorted(rows) == runners
    for script, cell in rows.items():
        tests = re.findall(r"`(tests/[\w/]+\.py)`", cell)
        assert tests or cell == "none", f"{script}: no test named in {cell!r}"
        for test in tests:  # the named test runs the script (or, for tests/gpu, gpu_check runs it through it)
            text = (ROOT / test).read_text()
            assert script.removesuffix(".py") in text, f"{test} does not name {script}"


def test_bench_holds_runners_a_readme_and_results():
    """No recipes, data, results or archived scripts beside the runners: results have their own folder, and a
    script that no longer runs against the package is deleted (git history keeps it)."""
    ignored = {"wheels", "__pycache__"}
    loose = sorted(p.name for p in BENCH.iterdir() if p.suffix != ".py" and p.name not in ignored)
    assert loose == ["README.md", "results"]
    assert not [p for p in (BENCH / "results").rglob("*") if p.is_file() and p.suffix not in {".json", ".jsonl"}]


def private_imports(path: Path) -> list[str]:
    """`from mha2gqa... import _x`, `import mha2gqa._x`, and `mha2gqa.x._y` / `module._y` on a module
    imported from the package."""
    tree = ast.parse(path.read_text())
    found, package_modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mha2gqa"):
            for alias in node.names:
                if alias.name.startswith("_") or any(p.startswith("_") for p in node.module.split(".")):
                    found.append(f"from {node.module} import {alias.name}")
                package_modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mha2gqa"):
                    if any(p.startswith("_") and p != "__main__" for p in alias.name.split(".")):
                        found.append(f"import {alias.name}")
                    package_modules.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in package_modules:
                found.append(f"{ast.unparse(node)}")
    return found


def test_no_bench_or_scripts_file_uses_a_private_name_of_the_package():
    scripts = sorted([*BENCH.rglob("*.py"), *(ROOT / "scripts").glob("*.py")])
    found = {p.relative_to(ROOT).as_posix(): private_imports(p) for p in scripts}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_private_name_check_sees_each_form(tmp_path):
    script = tmp_path / "x.py"
    script.write_text(
        "from mha2gqa.convert.refine import EXACT, _layer_path\nimport mha2gqa.convert.refine as r\n"
        "from mha2gqa.convert import refine\nr._attention_path(1)\nrefine._batch_one(2)\nrefine.EXACT\n"
    )
    assert private_imports(script) == [
        "from mha2gqa.convert.refine import _layer_path",
        "r._attention_path",
        "refine._batch_one",
    ]
