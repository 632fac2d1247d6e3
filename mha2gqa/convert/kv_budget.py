"""`convert --kv-budget X`: which kv-head count each layer keeps, so that the KV cache fits X and the measured
loss is least. Pure: no torch (the losses come from sensitivity.py).

X is a fraction of the parent's KV bytes per token (0.5) or bytes per token (12KiB, 24576). Every layer's K and V
cost the same per kv head (head_dim values each), so the budget is a whole number of kv heads summed over the
layers, and the choice is an exact knapsack: per layer one divisor of the source's kv heads, the summed losses
least, the summed counts within the budget (dynamic programming over layers x heads: at most layers x kv heads
states, 32 x 32 for a 7B).
"""

from __future__ import annotations

import re

from mha2gqa.architecture.layouts import AttentionShape
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.units import parse_size

FLAG = "--kv-budget"
WHOLE_PROPOSALS = 2  # placements the layer losses measure whole at most (layer_losses.WHOLE_SCALES)
BUDGET_BLOCKS = 8  # calibration blocks the layer losses are averaged over, unless --calibration-tokens says


def budget_heads(spec: str | float, shape: AttentionShape, dtype_bytes: int, flag: str = FLAG) -> int:
    """The budget as kv heads summed over layers: a fraction (0 < X <= 1) of the parent's, or bytes per token
    (a size, or an integer over 1), rounded down to whole heads. InputError outside [layers, layers x kv_heads)."""
    text = str(spec).strip()
    if shape.kv_heads == 1:
        raise InputError(
            f"{flag} {text}: SRC has one kv head in every layer already (num_key_value_heads=1): no budget can "
            "take less, so there is nothing to convert"
        )
    head_bytes = 2 * shape.head_dim * dtype_bytes  # K and V of one kv head, one token
    parent_heads = shape.layers * shape.kv_heads
    least, whole = shape.layers * head_bytes, parent_heads * head_bytes
    if re.fullmatch(r"0?\.\d+|1(\.0*)?", text):
        heads, asked = int(float(text) * parent_heads + 1e-9), f"{float(text):g} of the parent's KV bytes"
    elif not re.fullmatch(r"\d+(\.\d+)?\s*([KMGT]i?B|B)?", text, re.IGNORECASE):
        raise InputError(
            f"{flag} {text!r}: give a fraction of the parent's KV bytes per token (0 < X < 1, e.g. 0.5) or bytes "
            f"per token (e.g. {whole // 2}, half of this parent's {whole:,})"  # an example this parent accepts
        )
    else:
        heads = parse_size(text, flag) // head_bytes
        asked = f"{parse_size(text, flag):,} bytes per token"
    if heads < shape.layers:
        raise InputError(
            f"{flag} {text}: {asked} is less than one kv head per layer ({least:,} bytes per token, "
            f"{shape.layers / parent_heads:.3g} of the parent's {whole:,}); give at least that"
        )
    if heads >= parent_heads:
        raise InputError(
            f"{flag} {text}: {asked} holds the parent's whole KV cache ({whole:,} bytes per token): nothing to "
            "convert; give a fraction below 1 or fewer bytes"
        )
    return heads


def loss_tokens(shape: AttentionShape, tokens: int) -> int:
    """The layer losses of `tokens` calibration tokens as tokens through the whole parent (sensitivity.py): one
    parent pass, then for each layer i and each smaller count layers i.. again: (layers + 1) / 2 passes a count;
    as much again for the copy prompts built from the same tokens (layer_losses.py), then the whole-placement
    check: the parent and each placement measured whole (at most 2) once over both."""
    counts = len([g for g in shape.valid_groups() if g < shape.kv_heads])
    per_term = tokens * (1 + counts * (shape.layers + 1) / 2)
    return int(2 * per_term + 2 * tokens * (1 + WHOLE_PROPOSALS))


def choose_counts(losses: list[dict[int, float]], budget: int) -> tuple[int, ...]:
    """losses[layer][count]: the loss of that layer at that many kv heads (every count on offer, the parent's
    own at 0 loss). The counts, one per layer, whose losses sum least with counts summing to at most `budget`
    (ties: the larger counts, then the earlier layers' larger)."""
    # best[total] = (summed loss, counts) over the layers seen, using exactly `total` heads
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for per_count in losses:
        step: dict[int, tuple[float, tuple[int, ...]]] = {}
        for total, (loss, counts) in best.items():
            for count in sorted(per_count, reverse=True):
                new_total = total + count
                if new_total > budget:
                    continue
                candidate = (loss + per_count[count], counts + (count,))
                if new_total not in step or _better(candidate, step[new_total]):
                    step[new_total] = candidate
        best = step
    if not best:
        raise InputError(f"{FLAG}: no choice of kv heads per layer fits {budget} kv heads in all")
    return min(best.values(), key=lambda found: (found[0], tuple(-c for c in found[1])))[1]


def _better(candidate, incumbent) -> bool:
    return (candidate[0], tuple(-c for c in candidate[1])) < (incumbent[0], tuple(-c for c in incumbent[1]))


def choice_lines(
    counts: tuple[int, ...], losses: list[dict[int, float]], shape: AttentionShape, budget: int
) -> list[str]:
    """What the command prints: the counts, their KV share, and each layer's measured loss at its count."""
    used = sum(counts)
    parent = shape.layers * shape.kv_heads
    lines = [
        f"kv heads per layer: {','.join(map(str, counts))} ({used} of {parent} kv heads, {used / parent:.3f} of the "
        f"parent's KV bytes; budget {budget})",
        "layer  kv heads  loss (KL per token, this layer alone)",
    ]
    lines += [f"{layer:>5}  {count:>8}  {losses[layer][count]:.4g}" for layer, count in enumerate(counts)]
    return lines
