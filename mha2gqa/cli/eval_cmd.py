"""`mha2gqa eval` (measure one model) and `mha2gqa report` (compare many results)."""

from __future__ import annotations

import click

from mha2gqa.cli.fields import TokenCount, field_option
from mha2gqa.cli.paths import file_option, folder_option
from mha2gqa.estimates.stages import EVAL
from mha2gqa.eval.options import DecodePath, EvalOptions, SpeedPreset
from mha2gqa.files import jsontext
from mha2gqa.runtime.docfields import choice_docs
from mha2gqa.runtime.units import format_bytes


def _option(flag: str, *decls: str, **kwargs):
    """The option that sets an EvalOptions field: its default and help are the field's."""
    return field_option(EvalOptions, flag, *decls, **kwargs)


def _list_of(kind, what: str, example: str):
    """A click callback: '1,4,16' -> (1, 4, 16) read by `kind`; None stays None (the preset or default decides)."""

    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return tuple(kind(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise click.BadParameter(f"{value!r} is not a comma-separated list of {what} (e.g. {example})") from None

    return parse


# each list's example is a value that flag accepts (tests/test_error_examples.py reads it back through the flag)
_batches = _list_of(int, "integers", "1,4,16")
_contexts = _list_of(int, "integers", "32,64")
_lengths = _list_of(int, "integers", "128,512")
_depths = _list_of(float, "numbers", "0.1,0.5,0.9")


class _BatchSize(click.ParamType):
    """A whole number, or auto."""

    name = "INTEGER|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number nor auto", param, ctx)


def _str_list(ctx, param, value):
    """'a,b' -> ['a', 'b']; a value with no names in it ('' or ',, ,') is refused, not ignored."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise click.BadParameter(f"{value!r} names no task: give comma-separated names (e.g. hellaswag,arc_easy)")
    return names


@click.command("eval", short_help="Measure MODEL: perplexity, agreement with a parent, KV-cache bytes, decode speed.")
@click.argument("model")
@_option("--data", multiple=True, metavar="[NAME=]TEXT", as_text=tuple)
@_option("--data-config")
@_option("--data-split")
@_option("--data-column")
@_option("--max-tokens", type=TokenCount())
@_option("--tokenizer")
@_option("--reference")
@_option("--context", type=int)
@_option("--stride", type=int)
@_option("--batch-size", type=_BatchSize())
@_option("--dtype")
@_option("--device")
@_option(
    "--speed",
    "speed_preset",
    type=click.Choice([p.value for p in SpeedPreset]),
    choices=choice_docs(SpeedPreset),
)
@_option("--speed-batches", callback=_batches)
@_option("--speed-contexts", callback=_contexts)
@_option("--new-tokens", type=int)
@_option("--repeats", type=int)
@_option("--decode-path", type=click.Choice([p.value for p in DecodePath]), choices=choice_docs(DecodePath))
@_option("--speed-side-by-side", is_flag=True)
@_option("--kv-cache/--no-kv-cache", field="kv_cache", is_flag=True)
@_option("--kv-batch")
@_option("--kv-tokens")
@_option("--attention-maps", "attention_text")
@_option("--attention-layer")
@_option("--attention-png", type=click.Path(dir_okay=False))
@_option("--lm-eval-tasks", callback=_str_list)
@_option("--lm-eval-limit", type=int)
@_option("--chat-template", is_flag=True)
@_option("--log-samples", type=click.Path(dir_okay=False))
@_option("--retrieval", is_flag=True)
@_option("--retrieval-lengths", callback=_lengths)
@_option("--retrieval-depths", callback=_depths)
@_option("--retrieval-samples", type=int)
@_option("--role", type=click.Choice(["parent", "converted", "uptrained"]))
@_option("--label")
@_option("--seed")
@_option("--out", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars, no estimate and no time taken.")
def eval_command(model, quiet, out, force, **options):
    """Measure MODEL (a local directory or a hub id when online): sliding-window perplexity on --data,
    agreement with --reference, KV-cache bytes per token (formula vs the live cache), greedy decode
    speed and peak memory; optionally attention maps, the long-context retrieval probe (--retrieval) and
    lm-eval tasks. Writes one result JSON that `mha2gqa report` compares.

    Example: mha2gqa eval ./llama-gqa8 --data prose=held_out.txt --data code=src/ --reference ./llama --out gqa8.json
    """
    from mha2gqa.cli.early import validate_eval
    from mha2gqa.estimates.clock import command_clock
    from mha2gqa.runtime import threads
    from mha2gqa.runtime.errors import import_torch

    options = validate_eval(model, options, out, force)  # paths and values, before torch's start-up
    clock = command_clock(quiet)  # the estimate, and the time taken at the end; -q: quiet
    import_torch()  # with interrupts held: a signal during torch's start-up would abort
    clock.stage(EVAL.load.name)
    from mha2gqa.eval.run import evaluate

    threads.apply(threads.for_model(model))

    result = evaluate(model, options=EvalOptions(**options, out=out, progress=not quiet), clock=clock)
    click.echo(summary(result), err=out is None)  # its warnings were shown as they came (evaluate warns)
    if out is None:
        click.echo(jsontext.dumps(result, indent=2))


def summary(result: dict) -> str:
    """One line per measurement, for the terminal."""
    model = result["model"]
    heads = ",".join(map(str, model["kv_heads_per_layer"])) if "kv_heads_per_layer" in model else model["kv_heads"]
    lines = [f"{result['label']} ({result['role']}): {heads}/{model['heads']} kv heads"]
    if result["perplexity"]:
        p = result["perplexity"]
        lines.append(
            f"  perplexity {p['perplexity']:.3f} over {p['tokens_scored']:,} tokens (context {p['context']}, stride {p['stride']})"
        )
    if result["agreement"]:
        a = result["agreement"]
        lines.append(
            f"  vs reference: KL {a['kl_mean']:.4f}, top-1 agreement {100 * a['top1_agreement']:.1f}%, "
            f"reference perplexity {a['reference_perplexity']:.3f}"
        )
    if len(result.get("domains") or {}) > 1:
        from mha2gqa.records.brief import domain_lines

        lines += domain_lines(result)
    if result.get("retrieval"):
        from mha2gqa.eval.retrieval import brief_lines

        lines += brief_lines(result["retrieval"])
    kv = result["kv_cache"]
    lines.append(
        f"  KV cache {format_bytes(kv['measured_bytes_per_token'])}/token measured, "
        f"{format_bytes(kv['formula_bytes_per_token'])} by formula: {'match' if kv['match'] else 'MISMATCH'}"
    )
    path = (result["speed"] or {}).get("decode_path")
    if path:
        lines.append(f"  decode path {path['name']}: {path['cache']} cache, {path['attention']} attention")
    for p in (result["speed"] or {}).get("points", []):
        low, high = p.get("tokens_per_s_iqr") or (None, None)
        spread = f" (IQR {low:,.1f}-{high:,.1f}, {p['repeats']} runs)" if low is not None and "repeats" in p else ""
        lines.append(
            f"  decode B={p['batch']} T={p['context']}: {p['tokens_per_s']:,.1f} tok/s{spread}, "
            f"peak {format_bytes(p['peak_memory_bytes'])} ({p['peak_memory_kind']})"
            + (f", load {p['load_average'][0]:.1f} on {p['cpu_count']} CPUs" if p.get("load_average") else "")
        )
    if result["attention_maps"]:
        lines.append(f"  attention maps: {result['attention_maps']['png']}")
    for task, section in ((result["lm_eval"] or {}).get("tasks") or {}).items():
        from mha2gqa.records.brief import lm_eval_brief

        shown = ", ".join(f"{name} {lm_eval_brief(name, m)}" for name, m in section["metrics"].items())
        lines.append(f"  {task} ({section['samples']} examples): {shown}")
    return "\n".join(lines)


@click.command("report", short_help="Compare eval results side by side: markdown, html and plots.")
@click.argument("results", nargs=-1, required=True, type=click.Path(dir_okay=False))
@folder_option("--out", "Directory for report.md, report.html, report.json and the PNG plots.", required=True)
@click.option("--baseline", help="Label or path of the result the others are compared with [default: the first].")
@file_option("--metrics", "An uptrain metrics.jsonl to plot as a training curve (repeatable).", multiple=True)
@click.option(
    "--speedup-apart",
    is_flag=True,
    help="Compute a speed-up from speeds timed in separate eval runs too (with a warning): by default only "
    "speeds timed side by side (eval --speed-side-by-side) give one.",
)
@click.option("--force", is_flag=True, help="Replace an earlier report in --out.")
def report_command(results, out, baseline, metrics, speedup_apart, force):
    """Compare RESULTS (JSON files written by `mha2gqa eval`) side by side: perplexity and its change vs the
    baseline, recovery of uptrained models, KL and top-1 agreement, KV bytes per token and saving, decode
    tokens/s and speed-up; plots of quality vs KV size, tokens/s vs batch, and the training curve.

    Example: mha2gqa report parent.json gqa.json gqa-uptrained.json --out report/ --metrics run/metrics.jsonl
    """
    from mha2gqa.report.side_by_side import write_report

    written = write_report(
        list(results), out, baseline=baseline, metrics=list(metrics) or None, speedup_apart=speedup_apart, force=force
    )
    for name, path in written.items():
        click.echo(f"wrote {path} ({name})")
