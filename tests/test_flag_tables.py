"""The docs' flag tables say what `mha2gqa convert` takes now: every flag of the one flag table (CONVERT_FLAGS)
is a row of docs/convert.md's or docs/refine.md's table, once, with its current default; every other row is
an option of `convert` too (--config, --plan-tensors). A flag added, removed or given a new default fails here
until the docs say so."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

from mha2gqa.cli import main
from mha2gqa.convert.options import CONVERT_FLAGS, Flag
from mha2gqa.runtime.units import format_size

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ("convert.md", "refine.md")
HEADER = "| flag | default | meaning |"


def default_text(flag: Flag) -> str:
    """A flag's default as the tables write it: `required`, `--seed` (taken from another flag), on / off for a
    switch, unset (the meaning says what then), else the value (a size as the flag takes it)."""
    if flag.required:
        return "required"
    if flag.default_from:
        return f"`--{flag.default_from}`"
    if flag.switch:
        return "on" if bool(flag.default) != flag.inverted else "off"
    default = flag.default
    if default is None:
        return "unset"
    if isinstance(default, Enum):
        return str(default.value)
    if flag.size:
        return default if isinstance(default, str) else format_size(default)
    return f"{default:g}" if isinstance(default, float) else str(default)


def table_rows(text: str) -> list[tuple[str, str]]:
    """(flag, default cell) of every row of the flag tables in a page's text."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.strip() == HEADER:
            inside = True
        elif inside and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((re.fullmatch(r"`(--[\w-]+)`", cells[0]).group(1), cells[1]))
        elif inside and not line.startswith("|"):
            inside = False
    return rows


def problems(rows: list[tuple[str, str]], flags: tuple[Flag, ...], other_options: set[str]) -> list[str]:
    """What the tables get wrong against `flags`: a flag missing or listed twice, a default that is not the
    current one, a row that is no option."""
    found = [f"{flag.flag}: not in a table" for flag in flags if flag.flag not in dict(rows)]
    seen = [name for name, _ in rows]
    found += [f"{name}: listed {seen.count(name)} times" for name in sorted(set(seen)) if seen.count(name) > 1]
    by_name = {flag.flag: flag for flag in flags}
    for name, cell in rows:
        if name in by_name and cell != default_text(by_name[name]):
            found.append(f"{name}: default {cell!r}, now {default_text(by_name[name])!r}")
        elif name not in by_name and name not in other_options:
            found.append(f"{name}: no option of convert")
    return found


def test_every_convert_flag_is_in_a_docs_table_with_its_current_default():
    rows = [row for page in PAGES for row in table_rows((DOCS / page).read_text())]
    options = {opt for param in main.commands["convert"].params for opt in param.opts if opt.startswith("--")}
    assert len(rows) >= len(CONVERT_FLAGS)
    assert problems(rows, CONVERT_FLAGS, options) == []


def test_a_stale_table_is_found():
    """The converse: a missing flag, a changed default, a row twice and one that is no option are each named."""
    text = "\n".join(
        [
            HEADER,
            "|---|---|---|",
            "| `--groups` | unset | kv heads |",
            "| `--seed` | 1 | the seed |",
            "| `--seed` | 0 | again |",
            "| `--gone` | off | retired |",
        ]
    )
    flags = tuple(flag for flag in CONVERT_FLAGS if flag.flag in ("--groups", "--seed", "--method"))
    assert problems(table_rows(text), flags, set()) == [
        "--method: not in a table",
        "--seed: listed 2 times",
        "--seed: default '1', now '0'",
        "--gone: no option of convert",
    ]
