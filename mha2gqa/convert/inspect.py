"""`inspect`: what a model's attention looks like and what each valid conversion would save.
Reads config.json only; parameters are counted on the meta device (no weights are read)."""

from __future__ import annotations

from mha2gqa.convert.roles import KV_ROLES, layer_names, unpack
from mha2gqa.layouts import attention_shape, layout_for, read_config
from mha2gqa.sources import resolve_model_dir


def _count_parameters(model_dir, layout, shape) -> tuple[int, int]:
    """(all parameters, parameters in K/V projections and key norms) of the model, from its config."""
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


def inspect_model(src, context: int = 4096, batch: int = 1) -> dict:
    model_dir = resolve_model_dir(src)
    config = read_config(model_dir)
    layout, shape = layout_for(config), attention_shape(config)
    params, kv_params = _count_parameters(model_dir, layout, shape)
    source_bytes = shape.kv_bytes_per_token()
    targets = []
    for groups in reversed(shape.valid_groups()):
        per_token = shape.kv_bytes_per_token(groups)
        targets.append({
            "kv_heads": groups,
            "queries_per_kv_head": shape.heads // groups,
            "kv_bytes_per_token": per_token,
            "kv_bytes_per_sequence": per_token * context,
            "kv_bytes_per_batch": per_token * context * batch,
            "saving": source_bytes / per_token,
            "parameters": params - kv_params + kv_params * groups // shape.kv_heads,
        })
    return {
        "model": str(src),
        "model_type": shape.model_type,
        "architecture": (config.get("architectures") or ["?"])[0],
        "layers": shape.layers,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_size": shape.hidden,
        "parameters": params,
        "dtype": shape.dtype,
        "context": context,
        "batch": batch,
        "targets": targets,
    }
