"""What the docs and the CLI say about themselves holds: links and named sections exist, one measured
duration for `demo --quick`, help texts whole, KV per sequence at the model's own context."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(page: Path) -> list[str]:
    in_code = False
    found = []
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.append(line.lstrip("#").strip())
    return found


def test_every_local_link_and_anchor_in_the_docs_exists():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in {_slug(h) for h in _headings(linked)}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such section)")
    assert broken == []


def test_sections_named_in_the_text_exist_where_they_are_said_to_be():
    """Prose like: the README section "Try it" (a section that moved leaves these behind)."""
    readme = _headings(ROOT / "README.md")
    missing = []
    for page in PAGES:
        for name in re.findall(r'README section "([^"]+)"', page.read_text().replace("\n", " ")):
            if not any(h.startswith(name) for h in readme):
                missing.append(f"{page.relative_to(ROOT)}: README section {name!r}")
    assert missing == []


def test_top_level_help_gives_each_command_a_whole_summary():
    from click.testing import CliRunner

    from mha2gqa.cli import main

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    commands = result.output.split("Commands:\n", 1)[1]
    summaries = re.split(r"\n  (?=\S)", "\n" + commands.rstrip())[1:]
    names = sorted(main.commands)
    assert [s.split()[0] for s in summaries] == names
    for summary in summaries:
        text = " ".join(summary.split()[1:])
        assert not text.endswith("...") and text.endswith("."), summary


def test_convert_method_is_a_choice_like_grouping_and_speed():
    import click

    from mha2gqa.cli import main
    from mha2gqa.convert.options import Method

    def option(command, name):
        return next(p for p in main.commands[command].params if p.name == name)

    assert isinstance(option("convert", "method").type, click.Choice)
    assert list(option("convert", "method").type.choices) == [m.value for m in Method]
    assert isinstance(option("convert", "grouping").type, click.Choice)
    assert isinstance(option("eval", "speed_preset").type, click.Choice)


_DURATION = re.compile(r"\b\d+(?:\.\d+)?\s*(?:s|sec|seconds?|min|minutes?)\b(?! per)|\babout (?:\w+ )?minutes?\b")


def test_demo_quick_has_one_measured_duration_with_its_load():
    """`demo --quick` was said to take 27 s, about 2 minutes and 2.8 minutes in three places: the README
    states the one measured time (with the load); the other pages and --help point to it (benchmarks.md
    compares thread counts side by side, each row with its load)."""
    from click.testing import CliRunner

    from mha2gqa.cli import main

    stated = []
    for page in PAGES:
        if page.name == "benchmarks.md":  # side-by-side measurements (threads), not the time to expect
            continue
        for paragraph in page.read_text().split("\n\n"):
            if "--quick" in paragraph and "demo" in paragraph and _DURATION.search(paragraph):
                stated.append((page.relative_to(ROOT).as_posix(), _DURATION.findall(paragraph)))
    assert [page for page, _ in stated] == ["README.md"], stated
    readme = next(p for p in (ROOT / "README.md").read_text().split("\n\n") if "--quick --out" in p)
    assert re.search(r"load(\s+average)?\s+\d", readme), readme
    help_text = CliRunner().invoke(main, ["demo", "--help"]).output
    assert not _DURATION.search(help_text.split("--quick", 1)[1].split("--alpha", 1)[0]), help_text
