"""Each layer's kv-head count: the one thing a conversion plan says about its target, however it was asked for.

`--groups G` is G in every layer, `--kv-heads-per-layer 4,2,1` one count a layer, and `--kv-budget X` leaves the
counts to the plan's "layer losses" stage (convert/layer_losses.py), which fills them before the merge. Everything
downstream (the tensor plan, the methods, refine, the writer, the check, the card) reads the counts and never asks
how they were chosen. Uniform counts write a stock config.json; counts that differ between layers write the
Nemotron-NAS format (nemotron_nas/blocks.py), whose readers build Llama blocks. Pure: no torch.
"""

from __future__ import annotations

from mha2gqa.architecture.layouts import DTYPE_BYTES, AttentionShape
from mha2gqa.convert.kv_budget import budget_heads, choose_counts
from mha2gqa.runtime.errors import InputError

GROUPS_FLAG, COUNTS_FLAG, BUDGET_FLAG = "--groups", "--kv-heads-per-layer", "--kv-budget"
# Counts that differ between layers are written as Nemotron-NAS, whose readers (vLLM's DeciLMDecoderLayer, ours,
# llama.cpp's deci) build Llama attention and MLP blocks.
PER_LAYER_PARENT_TYPES = ("llama",)


def asked_flag(options) -> str:
    """The flag that set the counts, for messages: what the user typed."""
    if options.kv_budget is not None:
        return BUDGET_FLAG
    return COUNTS_FLAG if options.kv_heads_per_layer is not None else GROUPS_FLAG


def validate_request(options) -> None:
    """One way of giving the counts: --groups, --kv-heads-per-layer or --kv-budget."""
    given = [
        flag
        for flag, value in (
            (GROUPS_FLAG, options.groups),
            (COUNTS_FLAG, options.kv_heads_per_layer),
            (BUDGET_FLAG, options.kv_budget),
        )
        if value is not None
    ]
    if len(given) > 1:
        first, second = given[:2]
        raise InputError(
            f"{first} and {second} both give the kv heads: give one ({GROUPS_FLAG}: every layer's count, "
            f"{COUNTS_FLAG}: one a layer, {BUDGET_FLAG}: the KV bytes that choose them)"
        )


def parse_counts(text: str) -> tuple[int, ...]:
    """'4,2,2' -> (4, 2, 2); InputError naming the flag for anything else."""
    words = [word.strip() for word in str(text).split(",")]
    if not all(word.isdigit() and int(word) > 0 for word in words):
        raise InputError(
            f"{COUNTS_FLAG} {text!r}: give one positive integer per layer, separated by commas "
            f"(e.g. {COUNTS_FLAG} {','.join(['2'] * 3)})"
        )
    return tuple(int(word) for word in words)


def validate_counts(counts: tuple[int, ...], shape: AttentionShape, flag: str = COUNTS_FLAG) -> None:
    """One count per layer, each a divisor of the source's kv heads, at least one below it."""
    listed = ", ".join(str(g) for g in shape.valid_groups())
    if len(counts) != shape.layers:
        raise InputError(
            f"{flag} gives {len(counts)} counts but SRC has {shape.layers} layers: give one kv-head count per layer"
        )
    for layer, count in enumerate(counts):
        if shape.kv_heads % count:
            raise InputError(
                f"{flag}: layer {layer}'s {count} must divide num_key_value_heads={shape.kv_heads} (valid: {listed})"
            )
    if min(counts) == shape.kv_heads:
        raise InputError(
            f"{flag}: every layer keeps its {shape.kv_heads} kv heads: nothing to convert; lower some (valid: {listed})"
        )


def given_counts(options, shape: AttentionShape) -> tuple[int, ...] | None:
    """The counts the request states (checked), or None where --kv-budget chooses them."""
    if options.groups is not None:
        return (options.groups,) * shape.layers
    if options.kv_heads_per_layer is not None:
        counts = parse_counts(options.kv_heads_per_layer)
        validate_counts(counts, shape)
        return counts
    return None


def budget_of(options, shape: AttentionShape) -> int:
    """--kv-budget as kv heads summed over the layers (refused by value now: before anything is read)."""
    return budget_heads(options.kv_budget, shape, DTYPE_BYTES[options.dtype or shape.dtype])


def provisional_counts(heads: int, shape: AttentionShape) -> tuple[int, ...]:
    """Counts that spend the whole budget of `heads` (the most any choice can write): what the plan prices and
    sizes DST's room by before the layer losses choose the real ones."""
    zero = [dict.fromkeys(shape.valid_groups(), 0.0) for _ in range(shape.layers)]
    return choose_counts(zero, heads)


def is_uniform(counts: tuple[int, ...]) -> bool:
    return len(set(counts)) == 1


def counts_words(counts: tuple[int, ...]) -> str:
    """'2' for a uniform conversion, '4,2,1 (per layer)' otherwise."""
    return str(counts[0]) if is_uniform(counts) else ",".join(map(str, counts)) + " (per layer)"


def target_words(counts: tuple[int, ...]) -> list[str]:
    """The flag and value that write these counts again: --groups G, or --kv-heads-per-layer with the counts."""
    if is_uniform(counts):
        return [GROUPS_FLAG, str(counts[0])]
    return [COUNTS_FLAG, ",".join(map(str, counts))]


def validate_per_layer_parent(config: dict, flag: str) -> None:
    """Counts that differ between layers: a parent whose blocks the Nemotron-NAS readers build."""
    from mha2gqa.architecture.layouts import validate_target
    from mha2gqa.nemotron_nas.blocks import nemotron_nas_config

    validate_target(config, 1, flag)  # a per-layer child as SRC: convert its parent
    if config.get("model_type") not in PER_LAYER_PARENT_TYPES:
        raise InputError(
            f"{flag}: SRC has model_type {config.get('model_type')!r}; per-layer kv heads are written in the "
            f"Nemotron-NAS format, whose readers build Llama blocks (supported: {', '.join(PER_LAYER_PARENT_TYPES)}); "
            f"use {GROUPS_FLAG} for this model"
        )
    nemotron_nas_config(config, [config.get("num_key_value_heads") or 1] * config["num_hidden_layers"])
