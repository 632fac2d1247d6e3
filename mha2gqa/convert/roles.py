"""One layer's attention tensors under canonical role names, whatever the checkpoint's layout.

Methods see the same dict for every architecture:
    q.weight (H*hd, d)   q.bias (H*hd,)      o.weight (d, H*hd)   o.bias (d,)
    k.weight (n_kv*hd, d) k.bias (n_kv*hd,)  v.weight / v.bias like k
    k_norm.weight (n_kv*hd,) [k_norm.bias]   a key norm with one slice per kv head
unpack() maps a layout's tensors onto these roles (splitting phi3's fused qkv_proj or gpt2's Conv1D
c_attn, stacking stablelm's per-head norms) and pack() maps them back, so adding a layout never
touches a method. Both take torch tensors or numpy arrays (the torch-free executor, fast.py), so
there is one mapping for both executors.
"""

from __future__ import annotations

import itertools
import re
import warnings
from typing import TYPE_CHECKING

from mha2gqa.architecture.layouts import AttentionShape, Layout
from mha2gqa.runtime.errors import InputError, WeightWarning

if TYPE_CHECKING:  # torch is imported where tensors are joined, so `inspect` (names only) never loads it
    import torch

KINDS = ("weight", "bias")
KV_ROLES = ("k.weight", "k.bias", "v.weight", "v.bias", "k_norm.weight", "k_norm.bias")


def layer_names(layout: Layout, layer: int, kv_heads: int, available: set[str]) -> dict[str, str]:
    """Checkpoint name of every attention tensor of `layer` present in the checkpoint, by role
    (fused/per-head roles are named as stored: `qkv.weight`, `k_norm.{j}.weight`)."""
    prefix = layout.layer_prefix.format(layer=layer)
    fused = layout.qkv or layout.qkv_columns
    fused_role = "qkv" if layout.qkv else "qkv_t"  # qkv_t: gpt2's Conv1D, q/k/v as columns
    modules = {fused_role: fused} if fused else {"q": layout.q, "k": layout.k, "v": layout.v}
    modules["o"] = layout.o
    if layout.k_norm_rows:
        modules["k_norm"] = layout.k_norm_rows
    if layout.k_norm_per_head:
        for head in range(kv_heads):
            modules[f"k_norm.{head}"] = layout.k_norm_per_head.format(head=head)
    names = {}
    for role, module in modules.items():
        for kind in KINDS:
            name = f"{prefix}{module}.{kind}"
            if name in available:
                names[f"{role}.{kind}"] = name
    required = [f"{fused_role}.weight"] if fused else ["k.weight", "v.weight"]
    for role in required:
        if role not in names:
            module = fused or getattr(layout, role[0])
            raise InputError(
                f"checkpoint has no tensor {prefix}{module}.weight: its names do not match the layout of its "
                "model_type; check config.json's model_type"
            )
    return names


def validate_layer_count(available: set[str], layout: Layout, shape: AttentionShape) -> None:
    """num_hidden_layers against the checkpoint: name the missing (or extra) layers, not the model_type.
    Costs one pass over the names whatever num_hidden_layers says (a config may claim 10^12)."""
    before, after = layout.layer_prefix.split("{layer}")
    pattern = re.compile(re.escape(before) + r"(\d+)" + re.escape(after))
    present = {int(m.group(1)) for m in map(pattern.match, available) if m}
    found = sum(1 for layer in present if layer < shape.layers)
    if 0 < found < shape.layers:  # none at all: the names do not fit the layout (layer_names says so)
        missing = list(itertools.islice((n for n in range(shape.layers) if n not in present), 8))
        shown = ", ".join(map(str, missing)) + (", ..." if shape.layers - found > 8 else "")
        module = layout.qkv or layout.qkv_columns or layout.k
        example = f"{layout.layer_prefix.format(layer=missing[0])}{module}.weight"
        raise InputError(
            f"config.json has num_hidden_layers={shape.layers} but the checkpoint has no tensors for "
            f"layer(s) {shown} (e.g. no {example}): fix num_hidden_layers or use the complete checkpoint"
        )
    if shape.layers in present:  # e.g. a multi-token-prediction layer (GLM-4.5) that transformers ignores
        warnings.warn(
            f"the checkpoint has tensors for layer {shape.layers} "
            f"({layout.layer_prefix.format(layer=shape.layers)}*) beyond config.json's num_hidden_layers="
            f"{shape.layers}: they are copied unconverted; if the config is wrong, fix num_hidden_layers",
            WeightWarning,
            stacklevel=3,
        )


def _cat(parts: list):
    """torch.cat or numpy.concatenate, whichever the parts are."""
    if type(parts[0]).__module__.split(".")[0] == "torch":
        import torch

        return torch.cat(parts)
    import numpy

    return numpy.concatenate(parts)


def unpack(stored: dict[str, torch.Tensor], shape: AttentionShape) -> dict[str, torch.Tensor]:
    """Stored-role tensors (or numpy arrays) -> canonical roles (views where possible)."""
    roles = {}
    q_rows = shape.heads * shape.head_dim
    kv_rows = shape.kv_heads * shape.head_dim
    per_head_norms: dict[str, list] = {}
    for role, tensor in stored.items():
        part, kind = role.rsplit(".", 1)
        if part in ("qkv", "qkv_t"):  # rows [q (H*hd) | k (n_kv*hd) | v (n_kv*hd)]; qkv_t: (d, rows) columns
            rows = tensor.T if part == "qkv_t" and kind == "weight" else tensor  # .T: a 2-D weight
            if rows.shape[0] != q_rows + 2 * kv_rows:
                raise ValueError(f"{role} has {rows.shape[0]} rows, not q {q_rows} + k, v {kv_rows} each")
            q, k, v = rows[:q_rows], rows[q_rows : q_rows + kv_rows], rows[q_rows + kv_rows :]
            roles.update({f"q.{kind}": q, f"k.{kind}": k, f"v.{kind}": v})
        elif part.startswith("k_norm."):  # stablelm: one (hd,) norm per kv head
            per_head_norms.setdefault(kind, [None] * shape.kv_heads)[int(part.split(".")[1])] = tensor
        else:
            roles[role] = tensor
    for kind, norms in per_head_norms.items():
        roles[f"k_norm.{kind}"] = _cat(norms)  # (n_kv*hd,)
    return roles


def pack(roles: dict[str, torch.Tensor], stored_roles: list[str], kv_heads: int) -> dict[str, torch.Tensor]:
    """Canonical roles -> the stored roles of `stored_roles`' layout, for a model with `kv_heads`."""
    stored = {}
    for role in stored_roles:
        part, kind = role.rsplit(".", 1)
        if part in ("qkv", "qkv_t"):  # qkv_t is written as Linear rows: its target (gpt_bigcode) has no Conv1D
            stored[role] = _cat([roles[f"q.{kind}"], roles[f"k.{kind}"], roles[f"v.{kind}"]])
        elif part.startswith("k_norm."):
            head = int(part.split(".")[1])
            if head < kv_heads:  # norms of heads past the new count are dropped
                norms = roles[f"k_norm.{kind}"]  # (kv_heads*hd,)
                size = norms.shape[0] // kv_heads
                stored[role] = norms[head * size : (head + 1) * size]
        else:
            stored[role] = roles[role]
    return stored
