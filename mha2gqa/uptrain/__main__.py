"""`accelerate launch -m mha2gqa.uptrain --recipe R [--resume] [key=value ...]`: every rank runs the
same recipe (one process: `python -m mha2gqa.uptrain ...` or `mha2gqa uptrain ...`)."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="accelerate launch -m mha2gqa.uptrain",
        description="Uptrain (continue pre-training) a model from a YAML recipe; see recipes/*.yaml.",
    )
    parser.add_argument("--recipe", required=True, help="YAML recipe (schema: mha2gqa/uptrain/recipe.py)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe keys, dotted for sections")
    args = parser.parse_intermixed_args(argv)  # key=value may come before or after flags

    from mha2gqa.runtime.errors import exit_report, signals_as_interrupts
    from mha2gqa.runtime.progress import close_open_bars
    from mha2gqa.uptrain import load_recipe, train
    from mha2gqa.uptrain.guard import TrainingDiverged

    # The same rules as the mha2gqa CLI: a user mistake is one line and exit 2, nothing written; SIGTERM and
    # SIGHUP (what a launcher or a scheduler sends) unwind like Ctrl-C, so the same cleanups run.
    try:
        with signals_as_interrupts():
            out = train(load_recipe(args.recipe, args.overrides), resume=args.resume)
    except TrainingDiverged as err:
        close_open_bars()
        print(f"Error: {err}", file=sys.stderr)
        return 1
    except (Exception, KeyboardInterrupt) as err:
        close_open_bars()  # the line goes below the bars, not onto one
        report = exit_report(err)
        if report is None:
            raise
        print(report[0], file=sys.stderr)
        return report[1]
    if os.environ.get("RANK", "0") == "0":  # set by accelerate launch; one line, not one per rank
        print(f"output: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
