"""`mha2gqa sweep`: which kv-head count and method to pick, before any training."""

from __future__ import annotations

import click

from mha2gqa.cli.fields import TokenCount, field_option
from mha2gqa.convert.options import METHOD_SUMMARIES
from mha2gqa.runtime.docfields import option_help
from mha2gqa.sweep.options import SweepOptions


def _names(text: str | None, flag: str, example: str) -> list[str] | None:
    """'a,b' -> ['a', 'b']; None (not given) stays None; a value that names nothing is refused in the
    flag's words, not read as "not given"."""
    if text is None:
        return None
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        from mha2gqa.runtime.errors import InputError

        raise InputError(f"{flag} {text!r} names nothing: give a comma-separated list, e.g. {example}")
    return names


def _counts(text: str | None) -> tuple[int, ...] | None:
    names = _names(text, "--groups", "4,2,1")
    if names is None:
        return None
    try:
        return tuple(int(v) for v in names)
    except ValueError:
        from mha2gqa.runtime.errors import InputError

        raise InputError(f"--groups {text!r} must be comma-separated whole numbers, e.g. 4,2,1") from None


def _budgets(text: str | None) -> tuple[str, ...] | None:
    names = _names(text, "--kv-budgets", "0.5,0.75")
    return tuple(names) if names else None


def _option(flag: str, *decls: str, **kwargs):
    """The option that sets a SweepOptions field: its default and help are the field's."""
    return field_option(SweepOptions, flag, *decls, **kwargs)


@click.command("sweep")
@click.argument("src")
@_option(
    "--calibration",
    metavar="DATA",
    multiple=True,
    as_text=lambda value: tuple(value) if isinstance(value, (list, tuple)) else (value,),
)
@_option("--data", multiple=True, metavar="[NAME=]EVAL_TEXT", as_text=tuple)
@_option("--out", required=True, type=click.Path(file_okay=False))
@_option("--groups", "-g")
@_option("--methods", choices=METHOD_SUMMARIES)
@_option("--kv-budgets", metavar="X,Y")
@click.option("--refine", is_flag=True, help=option_help(SweepOptions, "refine"))
@_option("--max-tokens", type=TokenCount())
@_option("--calibration-tokens", type=int)
@_option("--tolerance")
@_option("--keep", is_flag=True)
@_option("--retrieval", is_flag=True)
@_option("--seed")
@_option("--force", is_flag=True)
@_option("--resume", is_flag=True)
@_option("--dry-run", is_flag=True)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def sweep(
    src,
    calibration,
    data,
    out,
    groups,
    methods,
    kv_budgets,
    refine,
    max_tokens,
    calibration_tokens,
    tolerance,
    keep,
    retrieval,
    seed,
    force,
    resume,
    dry_run,
    quiet,
):
    """Convert SRC to every kv-head count (default: each divisor of its kv heads below it) with every method,
    from one calibration pass, and evaluate each against SRC on every EVAL_TEXT (default: the probe set):
    perplexity, KL and top-1 agreement per domain, KV bytes per token and per sequence, conversion time and memory. Writes OUT/sweep.json,
    sweep.md and sweep.html (table, perplexity vs KV plot with the Pareto front, with --refine a per-layer
    heat map) and prints a one-line recommendation. Ctrl-C keeps the finished candidates in sweep.json,
    and --resume continues from them.

    Example: mha2gqa sweep mha2gqa/data/austen-mha --calibration austen
    --data mha2gqa/data/austen/persuasion.txt.gz --out sweep/
    """
    from mha2gqa.convert.options import RefineOptions
    from mha2gqa.report.sweep_pages import write_pages
    from mha2gqa.sweep import sweep as run_sweep

    options = SweepOptions(
        calibration=list(calibration) if len(calibration) > 1 else calibration[0],
        data=tuple(data),
        out=out,
        groups=_counts(groups),
        methods=tuple(_names(methods, "--methods", "mean,calibrated") or SweepOptions.methods),
        kv_budgets=_budgets(kv_budgets),
        refine=RefineOptions(seed=seed) if refine else None,
        max_tokens=max_tokens,
        calibration_tokens=calibration_tokens,
        tolerance=tolerance,
        keep=keep,
        retrieval=retrieval,
        seed=seed,
        progress=not quiet,
        force=force,
        resume=resume,
        dry_run=dry_run,
    )
    record = run_sweep(src, options, echo=click.echo, pages=write_pages)
    if dry_run:
        return
    click.echo(f"wrote {out}/sweep.json, sweep.md, sweep.html")
    click.echo(record["recommendation"]["line"])
