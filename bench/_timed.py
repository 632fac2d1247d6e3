"""Runs one mha2gqa command in this process and appends its clock's record (every stage's estimate, measured
seconds and work) as one JSON line to FILE: `python bench/_timed.py FILE convert SRC DST -g 2 -q`.

The benchmarks that fit the estimate rates and check estimates against wall times run each command through
this, as a process of its own; the package offers the clock's observer seam (estimates.clock.observe) and
nothing else for them."""

from __future__ import annotations

import sys


def main() -> None:
    from mha2gqa.estimates.clock import observe
    from mha2gqa.files import jsontext

    path, args = sys.argv[1], sys.argv[2:]

    def append(record: dict) -> None:
        with open(path, "a") as f:
            f.write(jsontext.dumps(record) + "\n")

    observe(append)
    sys.argv = ["mha2gqa", *args]  # the record's "command", as the user would have typed it
    from mha2gqa.cli import main as cli

    cli()


if __name__ == "__main__":
    main()
