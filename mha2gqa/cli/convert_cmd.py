"""`mha2gqa convert` and `mha2gqa inspect`."""

from __future__ import annotations

from enum import Enum

import click
from click.core import ParameterSource

from mha2gqa.cli.fields import field_option
from mha2gqa.cli.format import human_count, table
from mha2gqa.convert.options import CONVERT_FLAGS, METHOD_SUMMARIES, ConvertOptions, Flag, Method, options_from_flags
from mha2gqa.files import jsontext
from mha2gqa.runtime.docfields import choice_docs, option_help
from mha2gqa.runtime.units import format_bytes, format_size


def _flag_option(flag: Flag):
    """The click option of one CONVERT_FLAGS entry: its default and help are its field's."""
    decls = [d for d in (flag.short, flag.key) if d]
    # Every switch has its --no-X too: it turns off a switch that a --config file turned on.
    name = f"{flag.flag}/--no-{flag.flag[2:]}" if flag.switch else flag.flag
    if flag.field == "refine":
        return click.option(name, flag.key, is_flag=True, help=option_help(ConvertOptions, "refine"))
    if flag.help:
        return click.option(name, *decls, is_flag=flag.switch, default=False, help=flag.help)
    default, kwargs = flag.default, {}
    if isinstance(default, Enum):
        kwargs["type"] = click.Choice([member.value for member in type(default)])
        kwargs["choices"] = METHOD_SUMMARIES if type(default) is Method else choice_docs(type(default))
    elif flag.type is not None and not flag.repeat:
        kwargs["type"] = flag.type
    if flag.size and isinstance(default, int):
        kwargs["as_text"] = format_size
    if flag.default_from:
        kwargs.update(default=None, show_default=f"--{flag.default_from}")
    if flag.default_words:
        kwargs["show_default"] = flag.default_words
    return field_option(
        flag.owner,
        name,
        *decls,
        field=flag.name,
        is_flag=flag.switch,
        multiple=flag.repeat,
        required=flag.required,
        metavar=flag.metavar,
        **kwargs,
    )


def _convert_flags(command):
    for flag in reversed(CONVERT_FLAGS):  # decorators apply bottom-up: --help lists the table's order
        command = _flag_option(flag)(command)
    return command


_CONFIG = "convert_config"  # ctx.meta key of the --config file read


def _read_config(ctx, param, value):
    """--config FILE (eager, so before any other option): its values become the flags' defaults, which click
    converts and checks as it does the flags' own words, and which a flag on the command line overrides."""
    if value is None:
        return
    from mha2gqa.convert.config_file import read_config

    config = read_config(value)
    ctx.default_map = {**(ctx.default_map or {}), **config.defaults}
    ctx.meta[_CONFIG] = config


class _ConvertCommand(click.Command):
    """A value from --config that click refuses is refused with the flag's message, and the file's key named."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.BadParameter as err:
            config, param = ctx.meta.get(_CONFIG), err.param
            if config and param is not None and ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT_MAP:
                err.message = f"{err.message.rstrip('.')} ({param.name}: in --config {config.path})"
            raise


@click.command(
    cls=_ConvertCommand, short_help="Convert SRC to grouped-query attention with GROUPS kv heads, written to DST."
)
@click.argument("src", required=False)
@click.argument("dst", required=False)
@click.option(
    "--config",
    metavar="FILE",
    is_eager=True,
    expose_value=False,
    callback=_read_config,
    help="A YAML file of these options, keyed by the flags' names with underscores (groups: 8, refine_steps: 40, "
    "calibration: [parent:0.5, corpus.txt:0.5]), plus source: and destination: for SRC and DST. A flag, SRC or DST "
    "given on the command line overrides the file's; one path alone is DST when the file names the source. "
    "Every conversion writes one, DST/convert.yaml, that makes it again.",
)
@_convert_flags
@click.option(
    "--plan-tensors",
    is_flag=True,
    help="With --dry-run: after the summary, every output tensor and what it is made of, one line each.",
)
def convert(src, dst, plan_tensors, **flags):
    """Convert the checkpoint SRC (a local directory with config.json and safetensors, or a hub id when
    online) into a grouped-query checkpoint DST with GROUPS kv heads.

    Tensors are streamed one at a time (memory stays flat), DST is built beside itself and renamed at
    the end (an interrupted run leaves no DST), and SRC is never modified. DST loads with plain
    AutoModelForCausalLM.from_pretrained; mha2gqa.json in DST records how it was made, and DST/convert.yaml
    makes it again: mha2gqa convert --config DST/convert.yaml OUT.

    Example: mha2gqa convert ./llama-2-7b ./llama-2-7b-gqa8 --groups 8
    """
    from mha2gqa.convert.config_file import paths
    from mha2gqa.convert.run import convert as run_convert
    from mha2gqa.convert.run import dry_run_time_line
    from mha2gqa.estimates.clock import command_clock
    from mha2gqa.runtime import threads

    src, dst = paths(src, dst, click.get_current_context().meta.get(_CONFIG))
    if flags["groups"] is None and flags["kv_heads_per_layer"] is None and flags["kv_budget"] is None:
        raise click.MissingParameter(param_hint="'--groups' / '-g'", param_type="option")
    ctx = click.get_current_context()
    unset = {key for key in flags if ctx.get_parameter_source(key) is ParameterSource.DEFAULT}
    options = options_from_flags(flags, unset)
    # The user's count, else torch's own, never one read from the load: float sums differ with the thread
    # count, and the card's Reproduce line promises the same bytes (mha2gqa.json records the count).
    threads.apply()
    clock = command_clock(quiet=not options.progress)  # the estimate before the work starts; -q: quiet
    result = run_convert(src, dst, options=options, clock=clock)
    if options.dry_run:  # the answer first: what would be written, the stages, memory and time; the tensors on request
        time_line = dry_run_time_line(result.plan)
        lines = [_written_line("would write", dst, result.plan), result.checked, *result.plan.describe(time_line)]
        if plan_tensors:
            lines += result.tensors.describe(result.plan.checkpoint.tensors)
        else:
            lines.append(
                f"(--plan-tensors lists the {len(result.tensors.output_tensors())} output tensors, each with its source)"
            )
        click.echo("\n".join(lines))
        return
    if result.retrieval_line:
        click.echo(result.retrieval_line)
    if result.kv_budget:
        from mha2gqa.convert.layer_losses import chosen_lines

        click.echo("\n".join(chosen_lines(result.plan)))
    if result.layers:
        click.echo(layer_table(result.layers))
    if result.refine:
        click.echo(refine_table(result.refine))
    click.echo(_written_line("wrote", dst, result.plan))
    click.echo(check_report(result.check))


def check_report(record: dict | None) -> str:
    """What the conversion kept (convert/check.py): the table, the verdict and the next commands; or why the
    check was skipped."""
    from mha2gqa.records.check_record import HEADERS, retrieval_line, table_rows, title

    if not record or "skipped" in record:
        return f"check: skipped ({(record or {}).get('skipped', 'not run')})"
    lines = [title(record), table(HEADERS, table_rows(record)), f"verdict: {record['verdict_line']}"]
    lines += [line for line in [retrieval_line(record)] if line]
    for i, command in enumerate(record.get("next", [])):
        lines.append(f"{'next' if i == 0 else '  or'}: {command}")
    return "\n".join(lines)


def _written_line(verb: str, dst, plan) -> str:
    """What a conversion writes (or would): its tensors and bytes, the kv heads and the KV-cache saving."""
    from mha2gqa.convert.counts import counts_words

    tensors, shape = plan.tensors, plan.shape
    if plan.budget_heads is not None and plan.chosen is None:  # a dry run: the layer losses have not chosen yet
        heads = f"kv heads per layer chosen within {plan.budget_heads} of {shape.layers * shape.kv_heads} in all"
        size = f"at most {format_bytes(tensors.bytes_out)}"
    else:
        heads = f"kv heads {shape.kv_heads} -> {counts_words(plan.counts)}"
        size = format_bytes(tensors.bytes_out)
    saving = shape.layers * shape.kv_heads / sum(plan.counts)  # every kv head of every layer costs the same
    return (
        f"{verb} {dst}: {len(tensors.output_tensors())} tensors, {size} (from {format_bytes(tensors.bytes_in)}); "
        f"{heads} by {tensors.method}, KV cache {saving:.3g}x smaller"
    )


def layer_table(layers: list[dict]) -> str:
    """Per-layer relative reconstruction errors of keys and values (and the kv order when regrouped)."""
    regrouped = any("kv_order" in row for row in layers)  # --keep-retrieval-heads regroups some layers only
    headers = ["layer", "key error", "value error"] + (["kv order"] if regrouped else [])
    rows = [
        [str(row["layer"])]
        + [f"{row.get(key, float('nan')):.4f}" for key in ("key_error", "value_error")]
        + ([" ".join(map(str, row.get("kv_order", []))) or "-"] if regrouped else [])
        for row in layers
    ]
    return table(headers, rows)


def refine_table(record: dict) -> str:
    """Per-layer relative attention-output error before/after --refine, on fit and held-out tokens."""
    keys = ["fit_error_before", "fit_error_after", "heldout_error_before", "heldout_error_after"]
    keys += ["opening_heldout_error_before", "opening_heldout_error_after"]
    headers = ["layer", "fit before", "fit after", "held-out before", "held-out after", "openings before", "after"]
    rows = [
        [str(row["layer"])] + [f"{row[key]:.4f}" if key in row else "-" for key in keys] for row in record["layers"]
    ]
    title = (
        f"refine: relative attention-output error, {record['fit_tokens']} fit and {record['heldout_tokens']} "
        "held-out calibration tokens"
    )
    if record.get("openings"):
        opened = record["openings"]
        title += f"; openings: {opened['heldout']} held-out of {opened['sequences']} (first positions, any token)"
    text = title + "\n" + table(headers, rows)
    stage = record.get("global")
    if stage:
        start, best = stage["checks"][0]["heldout_kl"], min(c["heldout_kl"] for c in stage["checks"])
        text += (
            f"\nall layers together: held-out KL to the parent {start:.4f} -> {best:.4f} (step {stage['best_step']}"
            f"{'; blocks and openings' if record.get('openings') else ''})"
        )
    return text


@click.command(short_help="Show SRC's attention and the KV-cache saving of every kv-head count.")
@click.argument("src")
@click.option(
    "--context",
    type=int,
    default=None,
    help="Sequence length for the per-sequence KV-cache size [default: the model's context length from its "
    "config.json, e.g. max_position_embeddings].",
)
@click.option("--batch", default=1, show_default=True, help="Batch size for the per-batch KV-cache size.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def inspect(src, context, batch, as_json):
    """Describe SRC's attention (from config.json and the safetensors headers; no weights are read)
    and, for every valid target kv-head count, the KV-cache bytes per token, per sequence of CONTEXT
    tokens and per BATCH, and the saving factor."""
    from mha2gqa.convert.inspect import inspect_model

    info = inspect_model(src, context=context, batch=batch)
    if as_json:
        click.echo(jsontext.dumps(info, indent=2))
        return
    per_layer = info["kv_heads_per_layer"]
    kv_heads = f"kv heads per layer {','.join(map(str, per_layer))}" if per_layer else f"{info['kv_heads']} kv heads"
    click.echo(
        f"{info['architecture']} ({info['model_type']}): {info['layers']} layers, {info['heads']} heads, "
        f"{kv_heads}, head_dim {info['head_dim']}, hidden {info['hidden_size']}, "
        f"{human_count(info['parameters'])} parameters, {info['dtype']}"
    )
    click.echo(f"layout: {info['layout']}; calibrated merge: {info['calibrated']}")
    if per_layer:  # no targets: convert takes no per-layer SRC; its own KV is the sum of its layers'
        click.echo(
            f"KV cache (each layer's kv heads): {format_bytes(info['kv_bytes_per_token'])} a token, "
            f"{format_bytes(info['kv_bytes_per_sequence'])} a sequence of {info['context']:,} tokens "
            f"({info['context_from']}), {format_bytes(info['kv_bytes_per_batch'])} a batch of {batch}"
        )
        return
    rows = [
        [
            str(t["kv_heads"]) + (" (now)" if t["kv_heads"] == info["kv_heads"] else ""),
            str(t["queries_per_kv_head"]),
            format_bytes(t["kv_bytes_per_token"]),
            format_bytes(t["kv_bytes_per_sequence"]),
            format_bytes(t["kv_bytes_per_batch"]),
            f"{t['saving']:g}x",
            human_count(t["parameters"]),
        ]
        for t in info["targets"]
    ]
    context = info["context"]
    headers = ["kv heads", "q per kv", "KV/token", f"KV/seq@{context}", f"KV/batch of {batch}", "saving", "params"]
    click.echo(table(headers, rows))
    click.echo(f"KV/seq at {context:,} tokens ({info['context_from']}); --context N for another length")
