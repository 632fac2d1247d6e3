"""`mha2gqa demo` and `mha2gqa reproduce`: the embedded default, end to end."""

from __future__ import annotations

from pathlib import Path

import click

from mha2gqa.cli.format import table
from mha2gqa.files.embedded import target_groups
from mha2gqa.runtime.units import format_bytes

# How each column of mha2gqa.demo.summary_rows prints (the label first, "bytes" as KiB/MiB).
_SPECS = ["", ".2f", ".4f", ".3f", "bytes", ".2f"]


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


def _cell(value, spec: str) -> str:
    if not isinstance(value, (int, float, str)) or (spec == "bytes" and not value):
        return "-"
    return format_bytes(value) if spec == "bytes" else format(value, spec)


def _summary(report_json: Path) -> str:
    from mha2gqa.demo import summary_rows

    headers, rows = summary_rows(report_json)
    return table(headers, [[_cell(value, spec) for value, spec in zip(row, _SPECS)] for row in rows])


def _out_option(default: str, help: str):
    """--out of a command that writes a run folder of its own (demo, reproduce): where it goes by default.
    Any path is taken here: the run folder's rule (run_folder.validate_folder) words each refusal."""
    return click.option("--out", default=default, show_default=True, type=click.Path(path_type=Path), help=help)


@click.command(short_help="Run the whole job on the embedded default: convert, evaluate, uptrain, report.")
@click.option(
    "--groups",
    default=2,
    show_default=True,
    help=f"Target kv heads for the embedded 8-head model ({_listed(target_groups())}).",
)
@_out_option("./mha2gqa-demo", "Where the converted and uptrained models, results and report go.")
@click.option(
    "--quick",
    is_flag=True,
    help="A shorter run: 16k tokens of the held-out novel, alpha=1%, no speed grid (README.md gives a measured time).",
)
@click.option(
    "--alpha",
    type=float,
    default=None,
    help="Uptraining budget as a fraction of the parent's pretraining tokens [default: 0.05; 0.01 with --quick].",
)
@click.option(
    "--force", is_flag=True, help="Replace an earlier demo run in OUT (as a whole: none of its files are kept)."
)
@click.option("--dry-run", is_flag=True, help="Check everything and print what the run would do; write nothing.")
def demo(groups, out, quick, alpha, force, dry_run):
    """Run the whole job on the embedded default (a small Llama MHA model trained on five Jane Austen
    novels; no download): inspect, convert to GROUPS kv heads by mean-pooling, evaluate the parent and
    the converted model on held-out Persuasion, uptrain for ALPHA of the parent's pretraining tokens,
    evaluate again, and write a side-by-side report (markdown, html, plots) under OUT."""
    from mha2gqa.demo import plan_demo, run_demo
    from mha2gqa.estimates.clock import Clock
    from mha2gqa.runtime import threads
    from mha2gqa.runtime.limits import validate_limits

    plan = plan_demo(out, groups=groups, quick=quick, alpha=alpha, force=force)  # every check, before torch
    validate_limits("demo", {"--groups": groups})  # after the plan's own rule, a divisor of the embedded model's 8
    if dry_run:
        click.echo("\n".join(plan.describe()))
        return
    threads.apply(threads.small_model_default())
    written = run_demo(out, echo=click.echo, plan=plan, clock=Clock(echo=click.echo))  # from the process' start
    click.echo(_summary(Path(written["json"])))
    click.echo(f"report: {written['html']}")


@click.command(short_help="Reproduce the GQA paper's ablations at small scale on the embedded default.")
@_out_option(
    "./mha2gqa-ablations",
    "Where ablations.json, ablations.md and the plots go (docs/ablations in a checkout holds the shipped ones).",
)
@click.option("--methods", default="mean,first,random", show_default=True, help="Conversion methods, comma-separated.")
@click.option("--kv-heads", default="1,2,4", show_default=True, help="Target kv-head counts, comma-separated.")
@click.option(
    "--alphas",
    default="0,0.025,0.05,0.1",
    show_default=True,
    help="Uptraining budgets (fractions of the parent's pretraining tokens), comma-separated.",
)
@click.option(
    "--eval-blocks", default=32, show_default=True, help="Held-out 512-token blocks of Persuasion per evaluation."
)
@click.option("--force", is_flag=True, help="Replace an earlier reproduce run in OUT (as a whole).")
@click.option("--dry-run", is_flag=True, help="Check everything and print the grid that would run; write nothing.")
def reproduce(out, methods, kv_heads, alphas, eval_blocks, force, dry_run):
    """Reproduce the GQA paper's ablations at small scale on the embedded default: perplexity on
    held-out Persuasion for every method x kv heads x alpha, as a table and plots under OUT."""
    from mha2gqa.demo import markdown_table, plan_reproduce
    from mha2gqa.demo import reproduce as run_reproduce
    from mha2gqa.runtime import threads
    from mha2gqa.runtime.limits import validate_limits

    kv_heads = _numbers(kv_heads, int, "--kv-heads", "1,2,4")
    validate_limits("reproduce", {"--kv-heads": kv_heads, "--eval-blocks": eval_blocks})
    plan = plan_reproduce(  # every check, before torch and before OUT is touched
        out,
        methods=_names(methods),
        kv_heads=kv_heads,
        alphas=_numbers(alphas, float, "--alphas", "0,0.05"),
        eval_blocks=eval_blocks,
        force=force,
    )
    if dry_run:
        click.echo("\n".join(plan.describe()))
        return
    threads.apply(threads.small_model_default())
    grid, written = run_reproduce(out, echo=click.echo, plan=plan)
    click.echo(markdown_table(grid))
    click.echo("wrote " + ", ".join(map(str, written.values())))


def _names(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def _numbers(text: str, kind, flag: str, example: str) -> tuple:
    from mha2gqa.runtime.errors import InputError

    kind_name = "whole numbers" if kind is int else "numbers"
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"{flag} {text!r} must be a comma-separated list of {kind_name}, e.g. {example}") from None
