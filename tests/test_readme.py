"""README.md is a front door, read in two minutes: under 110 lines, table cells of one short number or phrase,
and every number of its headline table a link to the page that measured it, with the command beside it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_readme_is_short_and_its_cells_are_short():
    text = README.read_text()
    assert len(text.splitlines()) < 110
    cells = [cell for line in text.splitlines() if line.startswith("|") for cell in line.strip("|").split("|")]
    assert cells and max(len(cell.strip()) for cell in cells) <= 200


def test_every_headline_number_links_to_a_page_and_names_its_command():
    rows = table_rows(README.read_text(), "| what | number | command |")
    assert len(rows) >= 8
    for what, number, command in rows:
        link = re.fullmatch(r"\[[^\]]*\d[^\]]*\]\((docs/[\w./-]+?\.md)(#[\w-]+)?\)( \([^)]*\))?", number)
        assert link, f"{what}: {number!r} is not one number linked to a docs page"
        assert (ROOT / link.group(1)).is_file(), number
        assert re.fullmatch(r"`(python |mha2gqa )[^`]+`", command), f"{what}: {command!r} names no command"
        linked = (ROOT / link.group(1)).read_text()
        value = re.match(r"\[([^\]]+)\]", number).group(1)
        assert value.replace(" of ", " ").split()[0] in linked, f"{value} is not on {link.group(1)}"


def test_the_readme_and_help_agree_on_the_default_method_and_calibration():
    """The README names the default method as `--method`'s default is, and the default calibration as the one
    prepare fills in (issue 36: the README once called calibrated + refine "the shipped default")."""
    from mha2gqa.convert.options import DEFAULT_CALIBRATION, ConvertOptions

    text = " ".join(README.read_text().split())
    method = ConvertOptions(groups=1).method.value
    assert f"# the default method, {method} " in text and f"The default method, {method}-pooling," in text
    assert "shipped default" not in text
    parts = {entry.split(":")[0] for entry in DEFAULT_CALIBRATION}
    assert (
        parts == {"parent", "austen"}
        and "its default calibration is the no-data mix, the parent's own samples and the embedded novels" in text
    )


def test_the_readme_is_a_front_door_of_at_most_900_words():
    """Issue 54: the README had grown to 1,315 words of histories; those live in docs/results.md now."""
    words = len(README.read_text().split())
    assert words <= 900, f"README.md has {words} words; move history to docs/results.md"
