"""convert's per-layer path: --kv-heads-per-layer (counts given) and --kv-budget (counts chosen), both written as
a Nemotron-NAS checkpoint (convert/per_layer.py). A path of its own: the mean merge is the only method, so the
flags of the uniform pipeline's other stages are refused here, each by name."""

from __future__ import annotations

import click

from mha2gqa.convert.options import CONVERT_FLAGS, Grouping, Method, options_from_flags
from mha2gqa.errors import InputError
from mha2gqa.units import format_bytes

COUNTS_FLAG, BUDGET_FLAG = "--kv-heads-per-layer", "--kv-budget"
# The uniform pipeline's flags a per-layer conversion does not take: the merge is the mean, contiguous groups.
_REFUSED = (
    "--groups",
    "--method",
    "--grouping",
    "--refine",
    "--dry-run",
    "--keep-retrieval-heads",
    "--retrieval-weight",
    "--check-retrieval",
)


def convert_per_layer(src, dst, flags: dict) -> None:
    from mha2gqa.convert.per_layer import execute_per_layer, parse_counts, plan_per_layer

    counts_text, budget = flags["kv_heads_per_layer"], flags["kv_budget"]
    if counts_text is not None and budget is not None:
        raise InputError(f"{COUNTS_FLAG} and {BUDGET_FLAG}: give one (the counts, or the budget that chooses them)")
    given = COUNTS_FLAG if counts_text is not None else BUDGET_FLAG
    _refuse_other_stages(flags, given, calibration_read=budget is not None)
    options = options_from_flags(dict(flags, groups=1, method=Method.MEAN.value))
    if budget is None:
        plan = plan_per_layer(src, dst, parse_counts(counts_text), options)
    else:
        from mha2gqa.convert.budget_run import plan_budget
        from mha2gqa.convert.kv_budget import choice_lines

        plan = plan_budget(src, dst, budget, options)
        losses = [{int(c): v for c, v in per.items()} for per in plan.chosen["losses"]]
        click.echo("\n".join(choice_lines(plan.counts, losses, plan.shape, plan.chosen["budget_kv_heads"])))
    execute_per_layer(plan, dst)
    before, after = plan.shape.kv_bytes_per_token(), plan.kv_bytes_per_token()
    click.echo(
        f"wrote {dst} (Nemotron-NAS, kv heads per layer {','.join(map(str, plan.counts))}); KV cache per token "
        f"{format_bytes(before)} -> {format_bytes(after)} ({after / before:.3f} of the parent's)"
    )


def _refuse_other_stages(flags: dict, given: str, calibration_read: bool) -> None:
    defaults = {flag.flag: flag for flag in CONVERT_FLAGS}
    for name in _REFUSED + (() if calibration_read else ("--calibration",)):
        flag = defaults[name]
        value = flags[flag.key]
        unset = value in (None, (), False) or (flag.flag == "--method" and value == Method.MEAN.value)
        unset = unset or (flag.flag == "--grouping" and value == Grouping.CONTIGUOUS.value)
        if not unset:
            raise InputError(
                f"{name} with {given}: a per-layer conversion mean-pools contiguous groups and writes at once; "
                f"leave {name} out"
            )
