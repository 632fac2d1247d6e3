"""docs/code.md names every package and module of mha2gqa/ (issue 54: serving/ and eval/measurements.py had gone
missing from it) and states the defaults it mentions as the code has them (it said 24 global steps after 64)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mha2gqa"
CODE_MAP = ROOT / "docs" / "code.md"


def entries() -> dict[str, str]:
    """The map's entries: {'cli/': its text, 'layouts.py': the text of its line, ...} (an entry starts at a name
    in the tree's first column and runs until the next one)."""
    block = CODE_MAP.read_text().split("```")[1]
    found: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        head = re.match(r"  (\S+)", line)
        if head:
            current = head.group(1)
            found[current] = ""
        if current:
            found[current] += " " + line
    return found


def test_every_package_and_module_is_named_in_the_code_map():
    mapped = entries()
    text = " ".join(mapped.values())
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if len(relative.parts) == 1:
            if not re.search(rf"(^|\s){re.escape(relative.name)}\s", text):
                missing.append(str(relative))
            continue
        package = relative.parts[0] + "/"
        assert package in mapped, f"docs/code.md has no entry for the package {package}"
        inner = [*relative.parts[1:-1], path.stem]
        if inner == ["__init__"]:
            continue
        words = re.findall(r"[\w/]+", mapped[package])
        names = {w.strip("/") for w in words} | {part for w in words for part in w.split("/")}
        if not set(inner) - {"__init__"} <= names:
            missing.append(str(relative))
    assert missing == [], f"docs/code.md does not name: {missing}"


def test_the_code_map_names_nothing_that_does_not_exist():
    for name in entries():
        target = PACKAGE / name.rstrip("/")
        assert target.exists(), f"docs/code.md names {name}, which mha2gqa/ does not hold"


def test_the_global_stage_default_in_the_code_map_is_the_code_s():
    from mha2gqa.convert.options import DEFAULT_REFINE_GLOBAL_STEPS

    stated = re.findall(r"(\d+) steps by default", CODE_MAP.read_text())
    assert stated == [str(DEFAULT_REFINE_GLOBAL_STEPS)]
