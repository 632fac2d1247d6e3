"""Tiny models with planted redundancy, for the calibrated merge's exactness tests.

Within each group, every kv head is the group's first head up to a map the calibrated merge can fold
exactly: keys by a complex scalar per RoPE frequency pair (random scale and phase) on the rotated
dims and any invertible map on the unrotated dims; values by a random orthogonal mixing. Mean-pooling
such heads loses information; the calibrated merge should lose none.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import SAMPLE_TEXT, make_tiny_model, make_tiny_tokenizer

from mha2gqa.architecture.layouts import attention_shape, layout_for
from mha2gqa.convert.roles import layer_names, pack, unpack


def rotary_dims_of(model, head_dim: int) -> int:
    params = getattr(model.config, "rope_parameters", None) or {}
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def commuting_map(head_dim: int, rot: int, gen: torch.Generator) -> torch.Tensor:
    """(hd, hd): a complex scalar per frequency pair (i, i + rot/2) on [0, rot), invertible on the rest."""
    half = rot // 2
    scale = 0.5 + torch.rand(half, generator=gen, dtype=torch.float64)
    phase = 2 * torch.pi * torch.rand(half, generator=gen, dtype=torch.float64)
    a, b = scale * torch.cos(phase), scale * torch.sin(phase)
    i = torch.arange(half)
    m = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    m[i, i], m[i, i + half], m[i + half, i], m[i + half, i + half] = a, -b, b, a
    rest = head_dim - rot
    m[rot:, rot:] = torch.eye(rest, dtype=torch.float64) + 0.3 * torch.randn(
        rest, rest, generator=gen, dtype=torch.float64
    )
    return m


def orthogonal(head_dim: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    return q


def plant_redundancy(model, groups: int, order: list[int] | None = None, seed: int = 0):
    """Make the kv heads order[g*r:(g+1)*r] of every layer one head up to foldable maps (in place)."""
    config = model.config.to_dict()
    shape, layout = attention_shape(config), layout_for(config)
    n, hd = shape.kv_heads, shape.head_dim
    rot = rotary_dims_of(model, hd)
    order = list(range(n)) if order is None else order
    r = n // groups
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    with torch.no_grad():
        for layer in range(shape.layers):
            names = layer_names(layout, layer, n, set(state))
            roles = dict(unpack({role: state[name] for role, name in names.items()}, shape))
            for part in ("k", "v"):
                maps = {j: commuting_map(hd, rot, gen) if part == "k" else orthogonal(hd, gen) for j in range(n)}
                for role in (f"{part}.weight", f"{part}.bias"):
                    if role not in roles:
                        continue
                    heads = roles[role].double().reshape(n, hd, -1).clone()  # (n, hd, d or 1)
                    for g in range(groups):
                        members = order[g * r : (g + 1) * r]
                        for j in members[1:]:
                            heads[j] = maps[j] @ heads[members[0]]
                    roles[role] = heads.reshape(roles[role].shape).to(roles[role].dtype)
            for role, tensor in pack(roles, list(names), n).items():
                state[names[role]].copy_(tensor)
    return model


def save_redundant_model(
    path: Path, model_type: str = "llama", groups: int = 2, order: list[int] | None = None, seed: int = 0, **overrides
):
    model = plant_redundancy(make_tiny_model(model_type, seed=seed, **overrides), groups, order, seed)
    model.save_pretrained(path)
    make_tiny_tokenizer(path)
    return model


def write_calibration_text(path: Path, copies: int = 8) -> Path:
    path.write_text(SAMPLE_TEXT * copies)
    return path
