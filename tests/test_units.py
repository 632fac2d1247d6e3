"""The shared small helpers: byte formatting and the first line of an error."""

import re
from pathlib import Path

from mha2gqa.runtime.errors import first_line
from mha2gqa.runtime.units import byte_unit, counted, format_bytes, format_size, parse_size

ROOT = Path(__file__).resolve().parents[1]


def test_format_bytes_terminal_and_report_styles():
    assert [format_bytes(n) for n in (0, 1023, 1024, 3 * 2**20 + 2**19, 5 * 2**40, 2**50)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "3.50 MiB",
        "5.00 TiB",
        "1024.00 TiB",
    ]
    assert format_bytes(-2048) == "-2.00 KiB"
    # the report and card style: one decimal, nothing above MiB
    assert [format_bytes(n, 1, "MiB") for n in (512, 12288, 3 * 2**30)] == ["512 B", "12.0 KiB", "3072.0 MiB"]
    assert byte_unit(3 * 2**20, largest="KiB") == (1024, "KiB")
    assert byte_unit(1000) == (1, "B")


def test_first_line_of_an_error():
    assert first_line(ValueError("  bad value\nTraceback lines\n")) == "bad value"
    assert first_line(ValueError("x" * 300), 160) == "x" * 160
    assert first_line(OSError(), default="OSError") == "OSError"
    assert first_line(KeyError("")) == "''"


def test_format_size_is_read_back_by_parse_size():
    assert [format_size(n) for n in (4 << 30, 512 << 20, 1536, 1000, 3 << 40)] == [
        "4GiB",
        "512MiB",
        "1536",
        "1000",
        "3TiB",
    ]
    assert all(parse_size(format_size(n)) == n for n in (4 << 30, 1, 1536, 5 * 10**9, 7 << 20))


def test_counted_says_one_or_many_in_words():
    assert [counted(1, "file"), counted(5, "file"), counted(0, "step")] == ["1 file", "5 files", "0 steps"]
    assert [counted(1, "process"), counted(2, "process")] == ["1 process", "2 processes"]
    assert counted(2, "training stage") == "2 training stages"


def test_no_message_counts_with_a_parenthesised_plural():
    """A counted noun in a message reads '1 checkpoint' or '3 checkpoints' (units.counted), never '3 checkpoint(s)':
    any f-string placeholder followed by a word ending in '(s)' is a count written the old way."""
    pattern = re.compile(r"\{[^{}]+\}\s+[\w. ]*?\w\(s\)")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "mha2gqa").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
    assert pattern.search('f"has {len(problems)} problem(s): "') and not pattern.search('f"layer(s) {shown}"')
