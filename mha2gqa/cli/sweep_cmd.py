"""`mha2gqa sweep`: which kv-head count and method to pick, before any training."""

from __future__ import annotations

import click

from mha2gqa.cli.eval_cmd import _int_list, _str_list
from mha2gqa.convert.options import DEFAULT_CALIBRATION_TOKENS, METHOD_SUMMARIES
from mha2gqa.docfields import option_help
from mha2gqa.sweep.options import DEFAULT_METHODS, DEFAULT_TOLERANCE, SweepOptions


def _help(field: str, choices: dict[str, str] | None = None) -> str:
    return option_help(SweepOptions, field, choices)


@click.command("sweep")
@click.argument("src")
@click.option("--calibration", required=True, metavar="DATA", help=_help("calibration"))
@click.option("--data", required=True, metavar="EVAL_TEXT", help=_help("data"))
@click.option("--out", required=True, type=click.Path(file_okay=False), help=_help("out"))
@click.option("--groups", "-g", callback=_int_list, help=_help("groups"))
@click.option(
    "--methods",
    default=",".join(DEFAULT_METHODS),
    show_default=True,
    callback=_str_list,
    help=_help("methods", METHOD_SUMMARIES),
)
@click.option("--refine", is_flag=True, help=_help("refine"))
@click.option("--max-tokens", type=int, help=_help("max_tokens"))
@click.option(
    "--calibration-tokens", default=DEFAULT_CALIBRATION_TOKENS, show_default=True, help=_help("calibration_tokens")
)
@click.option("--tolerance", default=DEFAULT_TOLERANCE, show_default=True, help=_help("tolerance"))
@click.option("--keep", is_flag=True, help=_help("keep"))
@click.option("--seed", default=0, show_default=True, help=_help("seed"))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def sweep(
    src, calibration, data, out, groups, methods, refine, max_tokens, calibration_tokens, tolerance, keep, seed, quiet
):
    """Convert SRC to every kv-head count (default: each divisor of its kv heads below it) with every method,
    from one calibration pass, and evaluate each against SRC on EVAL_TEXT: perplexity, KL and top-1
    agreement, KV bytes per token and per sequence, conversion time and memory. Writes OUT/sweep.json,
    sweep.md and sweep.html (table, perplexity vs KV plot with the Pareto front, with --refine a per-layer
    heat map) and prints a one-line recommendation. Ctrl-C keeps the finished candidates in sweep.json.

    Example: mha2gqa sweep mha2gqa/data/austen-mha --calibration austen
    --data mha2gqa/data/austen/persuasion.txt.gz --out sweep/
    """
    from mha2gqa.convert.options import RefineOptions
    from mha2gqa.sweep import sweep as run_sweep

    options = SweepOptions(
        calibration=calibration,
        data=data,
        out=out,
        groups=tuple(groups) if groups else None,
        methods=tuple(methods or ()),
        refine=RefineOptions(seed=seed) if refine else None,
        max_tokens=max_tokens,
        calibration_tokens=calibration_tokens,
        tolerance=tolerance,
        keep=keep,
        seed=seed,
        progress=not quiet,
    )
    record = run_sweep(src, options, echo=click.echo)
    click.echo(f"wrote {out}/sweep.json, sweep.md, sweep.html")
    click.echo(record["recommendation"]["line"])
