"""One layer's conversion with calibration: choose the grouping, run the method, measure the loss.

run.py calls transform_layer() for every layer step; it returns the converted roles and a JSON-able
report (reconstruction errors when calibration data was given, the kv-head order when grouping by
similarity or spreading retrieval kv heads, --keep-retrieval-heads). The errors are the relative
reconstruction error of each source head's keys (values) on the calibration tokens, through the map the method folds into q_proj (o_proj): the calibrated
merge reports its own maps; every other method folds nothing, so its maps are the identity.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mha2gqa.convert.calibrated import augment, relative_error
from mha2gqa.convert.grouping import pair_costs, permute_heads, similarity_order
from mha2gqa.convert.options import Grouping
from mha2gqa.convert.retrieval_keep import spread_order


def transform_layer(method, roles: dict, ctx, grouping: Grouping = Grouping.CONTIGUOUS) -> tuple[dict, dict]:
    """method: a methods.MethodSpec; roles: canonical roles of one layer; ctx: methods.LayerContext."""
    report: dict = {}
    shape = ctx.shape
    order = _order(roles, ctx, grouping) if ctx.groups > 1 else None  # with one group every order is the same
    if order is not None:
        roles = permute_heads(roles, order, shape.kv_heads, shape.head_dim)
        if ctx.retrieval_masses is not None:  # the masses follow their kv heads
            ctx = replace(ctx, retrieval_masses=ctx.retrieval_masses[order])
        report["kv_order"] = order
    # float64 copies taken before the method runs, so a method that reuses its input's memory cannot skew them
    before = {}
    if ctx.stats is not None:
        before = {
            part: augment(roles[f"{part}.weight"], roles.get(f"{part}.bias"), ctx.stats.gram.device) for part in _PARTS
        }
    out, measured = method.convert_layer(roles, ctx)
    if measured is None and ctx.stats is not None:
        measured = identity_errors(before, out, ctx)
    report.update(measured or {})
    return out, report


def _order(roles: dict, ctx, grouping: Grouping) -> list[int] | None:
    """The source kv heads' new order (group g: new heads [g*r, (g+1)*r)), or None to keep transformers' order:
    by similarity, and/or with retrieval kv heads spread over the groups (--keep-retrieval-heads)."""
    shape, stats = ctx.shape, ctx.stats
    similar = grouping == Grouping.SIMILARITY
    if ctx.retrieval_masses is None:
        if not similar:
            return None
        return similarity_order(
            roles, stats.gram.double(), shape.kv_heads, ctx.groups, shape.head_dim, stats.rotary_dims
        )
    costs = (
        pair_costs(roles, stats.gram.double(), shape.kv_heads, shape.head_dim, stats.rotary_dims) if similar else None
    )
    return spread_order(ctx.retrieval_masses, ctx.groups, costs)


_PARTS = {"k": "key_error", "v": "value_error"}


def identity_errors(before: dict, converted: dict, ctx) -> dict:
    """Errors of a method that folds nothing: source head j is compared with its group's new head.
    before: {"k"/"v": augmented source projection (n*hd, d+1) float64}."""
    gram, head_dim = ctx.stats.gram.double(), ctx.shape.head_dim
    maps = torch.eye(head_dim, dtype=torch.float64, device=gram.device).expand(ctx.shape.kv_heads, head_dim, head_dim)
    return {
        name: relative_error(
            before[part], augment(converted[f"{part}.weight"], converted.get(f"{part}.bias"), gram.device), maps, gram
        )
        for part, name in _PARTS.items()
    }
