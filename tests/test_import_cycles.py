"""The package's imports form no cycle: every `import` and `from ... import` of a mha2gqa module, at module
level or inside a function (a deferred import is still a dependency), read from the source files."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mha2gqa"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The mha2gqa modules `name` imports. `from mha2gqa import provenance` names the submodule;
    `from mha2gqa import __version__` names the package itself (an upward import)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, colouring)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_imports_form_no_cycle():
    known = module_names()
    edges = {name: imports_of(name, path, known) for name, path in known.items()}
    assert len(known) > 40 and edges["mha2gqa.convert.run"]  # the walk found the package and its imports
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_the_walk_finds_a_cycle_when_there_is_one(tmp_path):
    """The converse: the checker is not vacuous, and an upward import names the package itself."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    probe = tmp_path / "probe.py"
    probe.write_text("from mha2gqa import __version__\nfrom mha2gqa.records import provenance\nfrom . import errors\n")
    found = imports_of("mha2gqa.eval.probe", probe, module_names())
    assert found == {"mha2gqa", "mha2gqa.records.provenance", "mha2gqa.eval"}
