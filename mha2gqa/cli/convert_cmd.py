"""`mha2gqa convert` and `mha2gqa inspect`."""

from __future__ import annotations

import json

import click

from mha2gqa.cli.fields import field_option
from mha2gqa.cli.format import human_count, table
from mha2gqa.convert.options import METHOD_SUMMARIES, ConvertOptions, Grouping, Method, RefineOptions
from mha2gqa.docfields import choice_docs, option_help
from mha2gqa.units import format_bytes, format_size


def _option(flag: str, *decls: str, **kwargs):
    """The option that sets a ConvertOptions field: its default and help are the field's."""
    return field_option(ConvertOptions, flag, *decls, **kwargs)


def _refine_option(flag: str, field: str, **kwargs):
    """--refine-X sets RefineOptions.X (ConvertOptions.refine)."""
    return field_option(RefineOptions, flag, field=field, **kwargs)


@click.command(short_help="Convert SRC to grouped-query attention with GROUPS kv heads, written to DST.")
@click.argument("src")
@click.argument("dst")
@_option("--groups", "-g", type=int, required=True)
@_option("--method", type=click.Choice([m.value for m in Method]), choices=METHOD_SUMMARIES)
@_option("--seed")
@_option("--dtype")
@_option("--max-shard-size")
@_option("--force", is_flag=True)
@_option("--dry-run", is_flag=True)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_option("--calibration", metavar="DATA", multiple=True)
@_option("--calibration-tokens")
@_option("--calibration-memory", as_text=format_size)
@_option("--grouping", type=click.Choice([g.value for g in Grouping]), choices=choice_docs(Grouping))
@click.option("--refine", is_flag=True, help=option_help(ConvertOptions, "refine"))
@_refine_option("--refine-steps", "steps")
@_refine_option("--refine-lr", "lr")
@_refine_option("--refine-memory", "memory", as_text=format_size)
@_refine_option("--refine-tokens", "tokens", type=int)
@_refine_option("--refine-mlp", "mlp_output", is_flag=True)
@_refine_option("--refine-global-steps", "global_steps")
@_refine_option("--refine-global-lr", "global_lr")
def convert(
    src,
    dst,
    groups,
    method,
    seed,
    dtype,
    max_shard_size,
    force,
    dry_run,
    quiet,
    calibration,
    calibration_tokens,
    calibration_memory,
    grouping,
    refine,
    refine_steps,
    refine_lr,
    refine_memory,
    refine_tokens,
    refine_mlp,
    refine_global_steps,
    refine_global_lr,
):
    """Convert the checkpoint SRC (a local directory with config.json and safetensors, or a hub id when
    online) into a grouped-query checkpoint DST with GROUPS kv heads.

    Tensors are streamed one at a time (memory stays flat), DST is built beside itself and renamed at
    the end (an interrupted run leaves no DST), and SRC is never modified. DST loads with plain
    AutoModelForCausalLM.from_pretrained; mha2gqa.json in DST records how it was made.

    Example: mha2gqa convert ./llama-2-7b ./llama-2-7b-gqa8 --groups 8
    """
    from mha2gqa.convert.run import convert as run_convert
    from mha2gqa.convert.run import parse_size

    refine_options = (
        RefineOptions(
            refine_steps,
            refine_lr,
            parse_size(refine_memory, "--refine-memory"),
            tokens=refine_tokens,
            mlp_output=refine_mlp,
            global_steps=refine_global_steps,
            global_lr=refine_global_lr,
            seed=seed,
        )
        if refine
        else None
    )
    options = ConvertOptions(
        groups=groups,
        method=method,
        seed=seed,
        dtype=dtype,
        max_shard_size=max_shard_size,
        force=force,
        dry_run=dry_run,
        progress=not quiet,
        calibration=(list(calibration) if len(calibration) > 1 else calibration[0]) if calibration else None,
        calibration_tokens=calibration_tokens,
        calibration_memory=calibration_memory,
        grouping=grouping,
        refine=refine_options,
    )
    result = run_convert(src, dst, options=options)
    plan = result.plan
    if dry_run:
        for line in plan.describe(result.conversion.checkpoint.tensors) + result.conversion.describe():
            click.echo(line)
    if result.layers:
        click.echo(layer_table(result.layers))
    if result.refine:
        click.echo(refine_table(result.refine))
    saving = plan.shape.kv_heads / plan.groups
    verb = "would write" if dry_run else "wrote"
    click.echo(
        f"{verb} {dst}: {len(plan.output_tensors())} tensors, {format_bytes(plan.bytes_out)} "
        f"(from {format_bytes(plan.bytes_in)}); kv heads {plan.shape.kv_heads} -> {plan.groups} by {plan.method}, "
        f"KV cache {saving:g}x smaller"
    )


def layer_table(layers: list[dict]) -> str:
    """Per-layer relative reconstruction errors of keys and values (and the kv order when regrouped)."""
    headers = ["layer", "key error", "value error"] + (["kv order"] if "kv_order" in layers[0] else [])
    rows = [
        [str(row["layer"])]
        + [f"{row.get(key, float('nan')):.4f}" for key in ("key_error", "value_error")]
        + ([" ".join(map(str, row["kv_order"]))] if "kv_order" in row else [])
        for row in layers
    ]
    return table(headers, rows)


def refine_table(record: dict) -> str:
    """Per-layer relative attention-output error before/after --refine, on fit and held-out tokens, and the
    block stage's per-token relative layer-output error on the held-out tokens where it ran."""
    keys = ["fit_error_before", "fit_error_after", "heldout_error_before", "heldout_error_after"]
    headers = ["layer", "fit before", "fit after", "held-out before", "held-out after"]
    if any("output_heldout_error_after" in row for row in record["layers"]):
        keys += ["output_heldout_error_before", "output_heldout_error_after"]
        headers += ["layer output, held-out before", "after"]
    rows = [
        [str(row["layer"])] + [f"{row[key]:.4f}" if key in row else "-" for key in keys] for row in record["layers"]
    ]
    title = (
        f"refine: relative attention-output error, {record['fit_tokens']} fit and {record['heldout_tokens']} "
        "held-out calibration tokens"
    )
    text = title + "\n" + table(headers, rows)
    stage = record.get("global")
    if stage:
        start, best = stage["checks"][0]["heldout_kl"], min(c["heldout_kl"] for c in stage["checks"])
        text += (
            f"\nall layers together: held-out KL to the parent {start:.4f} -> {best:.4f} (step {stage['best_step']})"
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
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(
        f"{info['architecture']} ({info['model_type']}): {info['layers']} layers, {info['heads']} heads, "
        f"{info['kv_heads']} kv heads, head_dim {info['head_dim']}, hidden {info['hidden_size']}, "
        f"{human_count(info['parameters'])} parameters, {info['dtype']}"
    )
    click.echo(f"layout: {info['layout']}; calibrated merge: {info['calibrated']}")
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
