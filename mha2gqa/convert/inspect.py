"""`inspect`: what a model's attention looks like and what each valid conversion would save.
Reads config.json and the safetensors headers (shapes, no weights), so it answers without torch;
a directory with no weights has its parameters counted on the meta device instead."""

from __future__ import annotations

import math
import re
from pathlib import Path

from mha2gqa.architecture.layouts import attention_shape, describe_layout, layout_for, read_config
from mha2gqa.convert.roles import layer_names, validate_layer_count
from mha2gqa.files.checkpoint import SafetensorsCheckpoint
from mha2gqa.files.sources import resolve_model_dir
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.limits import validate_limits


def _count_parameters(model_dir, layout, shape) -> tuple[int, int]:
    """(all parameters, parameters in K/V projections and key norms) of the model: the stored tensors'
    shapes when its safetensors are here (tied weights are stored once, as they are counted once)."""
    if not any(Path(model_dir).glob("*.safetensors")):
        return _count_on_meta(model_dir, layout, shape)
    shapes = SafetensorsCheckpoint(model_dir).shapes
    available = set(shapes)  # once: a set per layer made 10,000 layers quadratic
    validate_layer_count(available, layout, shape)
    kv_params = sum(_kv_params(layout, layer, shape, available, shapes) for layer in range(shape.layers))
    return sum(math.prod(s) for s in shapes.values()), kv_params


def _kv_params(layout, layer: int, shape, available: set[str], shapes: dict) -> int:
    """Parameters of one layer's K/V projections and key norms (`shapes`: name -> shape)."""
    kv_rows = shape.kv_heads * shape.head_dim
    fused_rows = shape.heads * shape.head_dim + 2 * kv_rows
    count = 0
    for role, name in layer_names(layout, layer, shape.kv_heads, available).items():
        part, numel = role.rsplit(".", 1)[0], math.prod(shapes[name])
        if part in ("qkv", "qkv_t"):  # rows [q (H*hd) | k (n_kv*hd) | v (n_kv*hd)], as roles.unpack splits them
            count += numel // fused_rows * 2 * kv_rows
        elif part in ("k", "v") or part.startswith("k_norm"):
            count += numel
    return count


# A config without weights is counted on a model of at most this many layers, built on the meta device
# (about 5 ms of Python per layer: 10,000 layers took minutes). Deeper models repeat the pattern of the
# last PERIOD built layers, exact for uniform stacks and for patterns whose period divides PERIOD after
# up to META_LAYERS - PERIOD different first layers (dense layers before MoE ones).
META_LAYERS, PERIOD = 24, 12


def _count_on_meta(model_dir, layout, shape) -> tuple[int, int]:
    """The same count from the config alone: transformers builds the model on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    built = min(shape.layers, META_LAYERS)
    config.num_hidden_layers = built
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    before, after = layout.layer_prefix.split("{layer}")
    pattern = re.compile(re.escape(before) + r"(\d+)" + re.escape(after))
    per_layer = [0] * built
    for name, p in params.items():
        if match := pattern.match(name):
            per_layer[int(match.group(1))] += p.numel()
    available = set(params)
    kv_layer = [_kv_params(layout, layer, shape, available, shapes) for layer in range(built)]
    outside = sum(p.numel() for p in params.values()) - sum(per_layer)
    source = [layer if layer < built else built - PERIOD + (layer - built) % PERIOD for layer in range(shape.layers)]
    return outside + sum(per_layer[i] for i in source), sum(kv_layer[i] for i in source)


def _architecture(config: dict) -> str:
    """The model class config.json names, or '?' (the field is informative only: never trusted as a list)."""
    names = config.get("architectures")
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else "?"


# Where a config states its context length (families name it differently); without one, FALLBACK_CONTEXT.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", "n_ctx")
FALLBACK_CONTEXT = 4096


def model_context(config: dict) -> tuple[int, str]:
    """The model's own context length and where it came from (the config key, or the fallback)."""
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"config {key}"
    return FALLBACK_CONTEXT, "default: the config names no context length"


def inspect_model(src, context: int | None = None, batch: int = 1) -> dict:
    """Attention shape and KV-cache bytes of every valid target; per sequence at `context` tokens
    (default: the model's own context length, from its config)."""
    for flag, value in (("--context", context), ("--batch", batch)):
        if flag == "--context" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{flag} {value!r} must be a positive integer (tokens per sequence, sequences per batch)")
    validate_limits("inspect", {"--context": context, "--batch": batch})
    model_dir = resolve_model_dir(src)
    shapes = SafetensorsCheckpoint(model_dir).shapes if any(model_dir.glob("*.safetensors")) else None
    config = read_config(model_dir, shapes)
    context, context_from = (context, "--context") if context is not None else model_context(config)
    layout, shape = layout_for(config), attention_shape(config)
    params, kv_params = _count_parameters(model_dir, layout, shape)
    source_bytes = shape.kv_bytes_per_token()  # a per-layer model's: the sum of its layers'
    targets = []
    # gpt2 -> gpt_bigcode: multi-query only; a per-layer model (Nemotron-NAS) is no SRC convert takes: none
    reachable = [] if shape.layer_kv_heads else [1] if layout.target else shape.valid_groups()
    for groups in sorted({shape.kv_heads, *reachable} if reachable else (), reverse=True):
        per_token = shape.kv_bytes_per_token(groups)
        targets.append(
            {
                "kv_heads": groups,
                "queries_per_kv_head": shape.heads // groups,
                "kv_bytes_per_token": per_token,
                "kv_bytes_per_sequence": per_token * context,
                "kv_bytes_per_batch": per_token * context * batch,
                "saving": source_bytes / per_token,
                "parameters": params - kv_params + kv_params * groups // shape.kv_heads,
            }
        )
    return {
        "model": str(src),
        "model_type": shape.model_type,
        "architecture": _architecture(config),
        "layers": shape.layers,
        "heads": shape.heads,
        "kv_heads": None if shape.layer_kv_heads else shape.kv_heads,
        "kv_heads_per_layer": list(shape.layer_kv_heads) or None,
        "kv_bytes_per_token": source_bytes,
        "kv_bytes_per_sequence": source_bytes * context,
        "kv_bytes_per_batch": source_bytes * context * batch,
        "head_dim": shape.head_dim,
        "hidden_size": shape.hidden,
        "parameters": params,
        "dtype": shape.dtype,
        "context": context,
        "context_from": context_from,
        "batch": batch,
        "targets": targets,
        **describe_layout(config),
    }
