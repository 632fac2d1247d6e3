"""The package's layers, as README.md draws them: every import points down. A module imports its own package,
or a package of a lower layer; in every layer but the last (the shared modules) no package imports another.
The layers are read from the README's "Imports go one way" paragraph, so the drawing and the code cannot part."""

import re
from pathlib import Path

from test_import_cycles import imports_of, module_names

README = Path(__file__).resolve().parent.parent / "README.md"


def drawn_layers() -> list[set[str]]:
    """The README's layers, top first: `mha2gqa`, `cli` -> `demo`, `sweep` -> ... -> the shared modules (the
    last layer names a few; every package not drawn above it belongs there)."""
    text = " ".join(README.read_text().split())
    paragraph = re.search(r"Imports go one way, down these layers: (.*?)\. ", text).group(1)
    return [set(re.findall(r"`([\w.]+)`", part)) for part in paragraph.split("->")]


def package_of(module: str) -> str:
    """The unit a layer holds: mha2gqa.convert.refine.hooks -> convert, mha2gqa.estimates -> estimates; the
    root package (the lazy public API) is `mha2gqa`, and `python -m mha2gqa` (__main__) is the cli's."""
    parts = module.split(".")
    if len(parts) == 1:
        return "mha2gqa"
    return "cli" if parts[1] == "__main__" else parts[1]


def upward_imports(edges: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Each import that breaks the layering, as 'a -> b (why)'."""
    drawn = set().union(*layers[:-1])

    def depth(package: str) -> int:
        return next((i for i, layer in enumerate(layers[:-1]) if package in layer), len(layers) - 1)

    found = []
    for module, targets in sorted(edges.items()):
        here = package_of(module)
        for target in sorted(targets):
            there = package_of(target)
            if there == here or (depth(there) > depth(here)) or (here not in drawn and there not in drawn):
                continue
            why = "a layer above" if depth(there) < depth(here) else "the same layer"
            found.append(f"{module} -> {target} ({why})")
    return found


def test_every_import_points_down_the_layers_the_readme_draws():
    known = module_names()
    layers = drawn_layers()
    packages = {package_of(name) for name in known}
    assert len(layers) >= 5 and {"cli", "convert", "corpus"} <= set().union(*layers)
    assert set().union(*layers) <= packages, "the README names a package that does not exist"
    edges = {name: imports_of(name, path, known) for name, path in known.items()}
    assert edges["mha2gqa.uptrain.mixed_data"]  # the walk found imports
    assert upward_imports(edges, layers) == []


def test_an_upward_or_sideways_import_is_found():
    """The converse: the checker is not vacuous."""
    layers = [{"cli"}, {"sweep"}, {"convert", "eval"}, {"corpus"}, {"errors"}]
    edges = {
        "mha2gqa.eval.schema": {"mha2gqa.sweep.options", "mha2gqa.runtime.errors"},  # up
        "mha2gqa.eval.run": {"mha2gqa.convert.plan"},  # sideways, within a layer
        "mha2gqa.corpus.mix": {"mha2gqa.runtime.errors", "mha2gqa.corpus.textdata"},  # down, and its own package
        "mha2gqa.estimates": {"mha2gqa.corpus.textdata"},  # a shared module reaching up to corpus
        "mha2gqa.architecture.layouts": {"mha2gqa.files.reading"},  # shared modules import each other
        "mha2gqa.__main__": {"mha2gqa.cli"},
    }
    assert upward_imports(edges, layers) == [
        "mha2gqa.estimates -> mha2gqa.corpus.textdata (a layer above)",
        "mha2gqa.eval.run -> mha2gqa.convert.plan (the same layer)",
        "mha2gqa.eval.schema -> mha2gqa.sweep.options (a layer above)",
    ]
