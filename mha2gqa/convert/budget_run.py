"""`convert --kv-budget X`, start to end: check the request (per_layer.plan_per_layer, before anything is read in
earnest), measure each layer's loss at each kv-head count on a few calibration blocks (sensitivity.py), choose
the counts under the budget (kv_budget.py), and plan the per-layer conversion at them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mha2gqa.convert.inputs import block_length, calibration_input
from mha2gqa.convert.kv_budget import FLAG, budget_heads, choose_counts
from mha2gqa.convert.options import DEFAULT_CALIBRATION, ConvertOptions
from mha2gqa.convert.per_layer import PerLayerPlan, plan_per_layer
from mha2gqa.errors import InputError, import_torch
from mha2gqa.layouts import DTYPE_BYTES, AttentionShape
from mha2gqa.progress import progress_bar

BUDGET_BLOCKS = 8  # calibration blocks the losses are averaged over, unless --calibration-tokens says otherwise


@dataclass(frozen=True)
class MeasuredLosses:
    """Each layer's loss at each kv-head count of a parent (sensitivity.py), measured once: every budget of a
    sweep chooses from the same losses."""

    losses: list[dict[int, float]]  # losses[layer][count]
    record: dict  # the calibration read, for mha2gqa.json
    shape: AttentionShape


def plan_budget(src, dst, budget, options: ConvertOptions) -> PerLayerPlan:
    """The per-layer plan whose counts fit `budget` (kv_budget.budget_heads) with the least summed loss; its
    `chosen` holds the budget, the measured losses and the calibration read, for mha2gqa.json."""
    ones = plan_per_layer(src, dst, (1,) * _layers(src), budget_options(options))  # every check, any model's count
    budget_heads(budget, ones.shape, _dtype_bytes(ones.shape, options))  # a budget that cannot be met: now
    return plan_at_budget(src, dst, budget, measure_losses(ones, options), options)


def measure_losses(ones: PerLayerPlan, options: ConvertOptions) -> MeasuredLosses:
    """The losses on --calibration's first blocks (BUDGET_BLOCKS unless --calibration-tokens says otherwise);
    `ones`: a checked per-layer plan of the parent (any counts)."""
    shape, config = ones.shape, ones.base.config
    tokens = options.calibration_tokens or BUDGET_BLOCKS * block_length(config)
    spec = options.calibration if options.calibration is not None else list(DEFAULT_CALIBRATION)
    calibration = calibration_input(spec, tokens, block_length(config), shape.hidden)
    losses, record = _measure(ones, calibration, options)
    return MeasuredLosses(losses, record, shape)


def plan_at_budget(src, dst, budget, measured: MeasuredLosses, options: ConvertOptions) -> PerLayerPlan:
    """The per-layer plan of the counts `measured` chooses under `budget`, with its record (plan.chosen)."""
    shape, losses = measured.shape, measured.losses
    heads = budget_heads(budget, shape, _dtype_bytes(shape, options))
    counts = choose_counts(losses, heads)
    plan = plan_per_layer(src, dst, counts, budget_options(options))
    plan.chosen = {
        "budget": str(budget),
        "budget_kv_heads": heads,
        "kv_heads_used": sum(counts),
        "parent_kv_heads": shape.layers * shape.kv_heads,
        "loss": "KL(parent || model) per token, with only this layer's keys and values mean-pooled",
        "losses": [{str(count): loss for count, loss in sorted(per.items())} for per in losses],
        "predicted_loss": sum(losses[layer][count] for layer, count in enumerate(counts)),
        "calibration": measured.record,
    }
    return plan


def _dtype_bytes(shape: AttentionShape, options: ConvertOptions) -> int:
    return DTYPE_BYTES[options.dtype or shape.dtype]


def _layers(src) -> int:
    from mha2gqa.layouts import attention_shape, read_config
    from mha2gqa.sources import resolve_model_dir

    return attention_shape(read_config(resolve_model_dir(src))).layers


def _measure(ones: PerLayerPlan, calibration, options: ConvertOptions) -> tuple[list[dict], dict]:
    """Load the parent once, read the calibration blocks, and measure every (layer, count)'s loss."""
    import_torch()
    from mha2gqa.convert.calibration import load_source_model, read_ids
    from mha2gqa.convert.sensitivity import layer_losses

    source, shape = ones.base.source, ones.shape
    parent = load_source_model(source, progress=options.progress)
    ids, record = read_ids(source, calibration, parent, options.seed, options.progress)
    count = len(ids) // calibration.seq_len
    if count < 1:
        raise InputError(
            f"{FLAG}: the calibration gave {len(ids)} tokens, less than one block of {calibration.seq_len}: "
            "give more text with --calibration, or raise --calibration-tokens"
        )
    blocks = ids[: count * calibration.seq_len].reshape(count, calibration.seq_len)
    candidates = shape.valid_groups()
    bar = progress_bar(count * shape.layers * (len(candidates) - 1), "sensitivity", options.progress)
    losses = layer_losses(parent, blocks, shape, candidates, bar)
    bar.close()
    return losses, dict(record, blocks=count, seq_len=calibration.seq_len)


def budget_options(options: ConvertOptions) -> ConvertOptions:
    """The options the mean merge of a budget run reads: calibration is the sensitivities' only (not the merge's)."""
    return replace(options, calibration=None, calibration_tokens=None)
