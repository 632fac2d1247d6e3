"""`inspect`: what a model's attention looks like and what each valid conversion would save.
Reads config.json and the safetensors headers (shapes, no weights), so it answers without torch;
a directory with no weights has its parameters counted on the meta device instead."""

from __future__ import annotations

import math
from pathlib import Path

from mha2gqa.checkpoint import SafetensorsCheckpoint
from mha2gqa.convert.roles import KV_ROLES, check_layer_count, layer_names, unpack
from mha2gqa.errors import InputError
from mha2gqa.layouts import attention_shape, describe_layout, layout_for, read_config
from mha2gqa.sources import resolve_model_dir


def _count_parameters(model_dir, layout, shape) -> tuple[int, int]:
    """(all parameters, parameters in K/V projections and key norms) of the model: the stored tensors'
    shapes when its safetensors are here (tied weights are stored once, as they are counted once)."""
    if not any(Path(model_dir).glob("*.safetensors")):
        return _count_on_meta(model_dir, layout, shape)
    shapes = SafetensorsCheckpoint(model_dir).shapes
    kv_rows = shape.kv_heads * shape.head_dim
    fused_rows = shape.heads * shape.head_dim + 2 * kv_rows
    kv_params = 0
    check_layer_count(set(shapes), layout, shape)
    for layer in range(shape.layers):
        for role, name in layer_names(layout, layer, shape.kv_heads, set(shapes)).items():
            part, numel = role.rsplit(".", 1)[0], math.prod(shapes[name])
            if part in ("qkv", "qkv_t"):  # rows [q (H*hd) | k (n_kv*hd) | v (n_kv*hd)], as roles.unpack splits them
                kv_params += numel // fused_rows * 2 * kv_rows
            elif part in ("k", "v") or part.startswith("k_norm"):
                kv_params += numel
    return sum(math.prod(s) for s in shapes.values()), kv_params


def _count_on_meta(model_dir, layout, shape) -> tuple[int, int]:
    """The same count from the config alone: transformers builds the model on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())
    kv_params = 0
    for layer in range(shape.layers):
        stored = layer_names(layout, layer, shape.kv_heads, set(params))
        roles = unpack({role: params[name] for role, name in stored.items()}, shape)
        kv_params += sum(roles[role].numel() for role in KV_ROLES if role in roles)
    return sum(p.numel() for p in model.parameters()), kv_params


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
    model_dir = resolve_model_dir(src)
    shapes = SafetensorsCheckpoint(model_dir).shapes if any(model_dir.glob("*.safetensors")) else None
    config = read_config(model_dir, shapes)
    context, context_from = (context, "--context") if context is not None else model_context(config)
    layout, shape = layout_for(config), attention_shape(config)
    params, kv_params = _count_parameters(model_dir, layout, shape)
    source_bytes = shape.kv_bytes_per_token()
    targets = []
    reachable = [1] if layout.target else shape.valid_groups()  # gpt2 -> gpt_bigcode: multi-query only
    for groups in sorted({shape.kv_heads, *reachable}, reverse=True):
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
        "kv_heads": shape.kv_heads,
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
