"""How the kv heads of a group become one: the GQA paper's recipe (mean) and its ablations (first,
random). Pure tensor functions on one layer's canonical roles (see roles.py); fp32 inside, the
source dtype out.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mha2gqa.architecture.layouts import AttentionShape
from mha2gqa.convert.calibrated import calibrated_layer
from mha2gqa.convert.options import METHOD_SUMMARIES, Method
from mha2gqa.convert.roles import KINDS, KV_ROLES


@dataclass(frozen=True)
class LayerContext:
    shape: AttentionShape  # the source's attention geometry
    groups: int  # target kv heads
    layer: int
    seed: int = 0
    stats: object = None  # calibration statistics of this layer, for methods that use them
    # --keep-retrieval-heads: (kv_heads,) each source kv head's retrieval mass (retrieval_keep.py), None for a layer
    # without retrieval heads; the merge weighs kv head j by 1 + retrieval_weight x masses[j]
    retrieval_masses: torch.Tensor | None = None
    retrieval_weight: float = 0.0

    def kv_weights(self) -> torch.Tensor | None:
        """(kv_heads,) float64 weights of the source kv heads in their group's merge; None: all equal."""
        if self.retrieval_masses is None or self.retrieval_weight == 0:
            return None
        return 1.0 + self.retrieval_weight * self.retrieval_masses.double()


def group_heads(rows: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """(n_kv*hd, *rest) -> (G, r, hd, *rest): group g holds source heads [g*r, (g+1)*r), the order of
    transformers' repeat_kv, so query head i keeps reading kv head i // (H // G)."""
    per_head = rows.reshape(kv_heads, -1, *rows.shape[1:])  # (n_kv, hd, *rest)
    return per_head.reshape(groups, kv_heads // groups, *per_head.shape[1:])


def ungroup(pooled: torch.Tensor) -> torch.Tensor:
    """(G, hd, *rest) -> (G*hd, *rest)"""
    return pooled.reshape(-1, *pooled.shape[2:])


def _seeded(ctx: LayerContext, role: str) -> torch.Generator:
    # crc32, not hash(): Python salts str hashes per process, and runs must be reproducible.
    return torch.Generator().manual_seed(zlib.crc32(f"{ctx.seed}:{ctx.layer}:{role}".encode()))


def _reduce_kv(roles: dict, ctx: LayerContext, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> dict:
    out = dict(roles)
    for role in KV_ROLES:
        if role in roles:
            grouped = group_heads(roles[role], ctx.shape.kv_heads, ctx.groups)  # (G, r, hd, *rest), source dtype
            out[role] = ungroup(reduce(grouped, role)).to(roles[role].dtype)
    return out


def group_mean(grouped: torch.Tensor) -> torch.Tensor:
    """(G, r, ...) -> (G, ...) in fp32. Summing upcast slices is ~2.5x faster on CPU than upcasting
    the whole tensor first, and never holds more than one fp32 copy of the output."""
    total = grouped[:, 0].to(torch.float32, copy=True)  # a copy even for fp32: never add into the source
    for j in range(1, grouped.shape[1]):
        total += grouped[:, j]
    return total.div_(grouped.shape[1])


def group_weighted_mean(grouped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(G, r, ...), (G*r,) -> (G, ...) in fp32: each group's heads averaged with their weights."""
    w = weights.to(torch.float32).reshape(grouped.shape[0], grouped.shape[1])  # (G, r)
    w = w / w.sum(1, keepdim=True)
    return torch.einsum("gr,gr...->g...", w, grouped.float())


def mean_layer(roles: dict, ctx: LayerContext) -> dict:
    """Ainslie et al. 2023: each group's K/V projections (and biases, key norms) are averaged; with
    --keep-retrieval-heads, the kv heads retrieval heads read weigh more (ctx.kv_weights)."""
    weights = ctx.kv_weights()
    if weights is None:
        return _reduce_kv(roles, ctx, lambda grouped, role: group_mean(grouped))
    return _reduce_kv(roles, ctx, lambda grouped, role: group_weighted_mean(grouped, weights))


def first_layer(roles: dict, ctx: LayerContext) -> dict:
    """Ablation: each group keeps its first head."""
    return _reduce_kv(roles, ctx, lambda grouped, role: grouped[:, 0].float())


def random_layer(roles: dict, ctx: LayerContext) -> dict:
    """Ablation: projections re-drawn from a normal with the source tensor's mean and std (seeded).
    Key norms are mean-pooled: a random norm scale is not an initialisation anyone would use."""

    def reduce(grouped: torch.Tensor, role: str) -> torch.Tensor:
        if role.startswith("k_norm"):
            return group_mean(grouped)
        grouped = grouped.float()
        noise = torch.randn(grouped[:, 0].shape, generator=_seeded(ctx, role))
        return noise * grouped.std() + grouped.mean()

    return _reduce_kv(roles, ctx, reduce)


def mean_norm_layer(roles: dict, ctx: LayerContext) -> dict:
    """Mean-pooling, then each pooled K/V head rescaled to its group's mean norm (weight and bias
    together). Averaging r dissimilar heads shrinks the result, which flattens attention (keys) and
    damps the output (values); the rescale undoes that shrinkage without calibration data."""
    groups = ctx.groups
    parts = {part: [f"{part}.{kind}" for kind in KINDS if f"{part}.{kind}" in roles] for part in ("k", "v")}

    def norms(tensors: dict, names: list[str], heads: int) -> torch.Tensor:  # (heads,) norm of weight and bias
        return sum(tensors[name].float().reshape(heads, -1).pow(2).sum(1) for name in names).sqrt()

    targets = {
        part: norms(roles, names, ctx.shape.kv_heads).reshape(groups, -1).mean(1)  # (G,)
        for part, names in parts.items()
    }
    out = mean_layer(roles, ctx)
    for part, names in parts.items():
        scale = targets[part] / norms(out, names, groups).clamp_min(1e-12)  # (G,)
        for name in names:
            scaled = out[name].float().reshape(groups, -1) * scale[:, None]
            out[name] = scaled.reshape(out[name].shape).to(out[name].dtype)
    return out


def _no_report(convert_layer: Callable[[dict, LayerContext], dict]) -> Callable[[dict, LayerContext], tuple]:
    """A pooling method measures nothing itself: layer_step.py measures it through identity maps."""
    return lambda roles, ctx: (convert_layer(roles, ctx), None)


@dataclass(frozen=True)
class MethodSpec:
    convert_layer: Callable[[dict, LayerContext], tuple[dict, dict | None]]
    """One layer's roles -> (converted roles, JSON-able report of its own errors, or None)."""
    summary: str  # what each method needs and rewrites is Method's own (options.py, no torch)


METHODS: dict[Method, MethodSpec] = {
    Method.MEAN: MethodSpec(_no_report(mean_layer), METHOD_SUMMARIES["mean"]),
    Method.FIRST: MethodSpec(_no_report(first_layer), METHOD_SUMMARIES["first"]),
    Method.RANDOM: MethodSpec(_no_report(random_layer), METHOD_SUMMARIES["random"]),
    Method.MEAN_NORM: MethodSpec(_no_report(mean_norm_layer), METHOD_SUMMARIES["mean-norm"]),
    Method.CALIBRATED: MethodSpec(calibrated_layer, METHOD_SUMMARIES["calibrated"]),
}
