"""The "layer losses" stage of a --kv-budget conversion: each layer's loss at each kv-head count, measured through
the loaded parent on the calibration blocks (sensitivity.py), then the counts with the least summed loss within the
budget (kv_budget.choose_counts), which fill the plan's counts before the merge. A sweep measures the losses once
(measure_for) and passes them to every budget's plan, which then only chooses.
"""

from __future__ import annotations

from dataclasses import dataclass

from mha2gqa.convert.kv_budget import FLAG, choice_lines, choose_counts
from mha2gqa.errors import InputError
from mha2gqa.layouts import AttentionShape
from mha2gqa.progress import progress_bar

LOSS = "KL(parent || model) per token, with only this layer's keys and values mean-pooled"


@dataclass(frozen=True)
class MeasuredLosses:
    """Each layer's loss at each kv-head count of a parent, measured once: every budget chooses from them."""

    losses: list[dict[int, float]]  # losses[layer][count]
    record: dict  # the calibration read, for mha2gqa.json
    shape: AttentionShape


def measure(parent, ids, plan, record: dict) -> MeasuredLosses:
    """The losses on the plan's first loss blocks of `ids` (the calibration read: tokens of SRC's tokenizer)."""
    from mha2gqa.convert.sensitivity import layer_losses

    shape, seq_len = plan.shape, plan.calibration.seq_len
    count = min(plan.loss_blocks, len(ids) // seq_len)
    if count < 1:
        raise InputError(
            f"{FLAG}: the calibration gave {len(ids)} tokens, less than one block of {seq_len}: "
            "give more text with --calibration, or raise --calibration-tokens"
        )
    blocks = ids[: count * seq_len].reshape(count, seq_len)
    candidates = shape.valid_groups()
    bar = progress_bar(count * shape.layers * (len(candidates) - 1), "layer losses", plan.options.progress)
    losses = layer_losses(parent, blocks, shape, candidates, bar)
    bar.close()
    kept = {key: value for key, value in record.items() if key not in ("blocks", "seq_len")}
    return MeasuredLosses(losses, dict(kept, blocks=count, seq_len=seq_len), shape)


def measure_for(plan) -> MeasuredLosses:
    """The losses of a budget plan's parent, measured on their own (a sweep's, once for all its budgets)."""
    from mha2gqa.convert.calibration import load_source_model, read_ids

    options = plan.options
    parent = load_source_model(plan.source, plan.decided.device, progress=options.progress)
    ids, record = read_ids(plan.source, plan.calibration, parent, options.seed, options.progress)
    return measure(parent, ids, plan, record)


def choose(plan, measured: MeasuredLosses) -> tuple[tuple[int, ...], dict]:
    """The counts with the least summed loss within the plan's budget, and how they were chosen (mha2gqa.json)."""
    shape, losses, heads = measured.shape, measured.losses, plan.budget_heads
    counts = choose_counts(losses, heads)
    chosen = {
        "budget": str(plan.options.kv_budget),
        "budget_kv_heads": heads,
        "kv_heads_used": sum(counts),
        "parent_kv_heads": shape.layers * shape.kv_heads,
        "loss": LOSS,
        "losses": [{str(count): loss for count, loss in sorted(per.items())} for per in losses],
        "predicted_loss": sum(losses[layer][count] for layer, count in enumerate(counts)),
        "calibration": measured.record,
    }
    return counts, chosen


def chosen_lines(plan) -> list[str]:
    """What convert prints about the budget's choice: the counts, their KV share, each layer's loss."""
    chosen = plan.chosen
    losses = [{int(c): v for c, v in per.items()} for per in chosen["losses"]]
    return choice_lines(plan.counts, losses, plan.shape, chosen["budget_kv_heads"])
