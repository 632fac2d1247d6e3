"""Which parameters a recipe's `trainable` trains, by name: the training loop freezes the others (models.py) and the
dry run counts them from the checkpoint's headers (plan.py), so this module does not import torch."""

from __future__ import annotations

import math
import re

from mha2gqa.architecture.layouts import layout_for
from mha2gqa.runtime.errors import InputError


def patterns(config: dict, mode: str) -> list[re.Pattern]:
    """Regexes over parameter names for the attention (or k/v only) tensors of every layer."""
    layout = layout_for(config)
    if mode == "kv" and layout.qkv:
        raise InputError(f"trainable=kv: {config['model_type']} fuses q/k/v in one tensor; use trainable=attention")
    names = [layout.k, layout.v, layout.k_norm_rows, layout.k_norm_per_head]
    if mode == "attention":  # the whole attention module: projections and every norm in it (stablelm's
        names.append(layout.o.rsplit(".", 1)[0])  # per-head q_layernorm, olmo2's q_norm are no layout role)
    prefix = re.escape(layout.layer_prefix).replace(re.escape("{layer}"), r"\d+")
    out = []
    for name in filter(None, names):
        body = re.escape(name).replace(re.escape("{head}"), r"\d+")
        out.append(re.compile(rf"^{prefix}{body}\."))
    return out


def count(shapes: dict[str, tuple[int, ...]], config: dict, mode: str, lora=None) -> int:
    """Parameters `mode` trains among a checkpoint's tensors (name -> shape). For lora: the adapters' A and B
    (rank x (in + out)) on each 2-D weight of the target modules (every attention projection by default)."""
    if mode == "all":
        return sum(math.prod(shape) for shape in shapes.values())
    if mode == "lora":
        from mha2gqa.uptrain.lora import default_targets

        targets = lora.target_modules or default_targets(config)
        return sum(
            lora.rank * sum(shape)
            for name, shape in shapes.items()
            if len(shape) == 2 and name.endswith(".weight") and any(f"{t}.weight" in name for t in targets)
        )
    found = patterns(config, mode)
    return sum(math.prod(shape) for name, shape in shapes.items() if any(p.match(name) for p in found))
