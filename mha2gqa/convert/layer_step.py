"""One layer's conversion with calibration: choose the grouping, run the method, measure the loss.

run.py calls transform_layer() for every layer step; it returns the converted roles and a JSON-able
report (reconstruction errors when calibration data was given, the kv-head order when grouping by
similarity). The errors are the relative reconstruction error of each source head's keys (values)
on the calibration tokens, through the map the method folds into q_proj (o_proj): the calibrated
merge reports its own maps; every other method folds nothing, so its maps are the identity.
"""

from __future__ import annotations

import torch

from mha2gqa.convert.calibrated import augment, relative_error
from mha2gqa.convert.grouping import permute_heads, similarity_order
from mha2gqa.convert.options import Grouping


def transform_layer(method, roles: dict, ctx, grouping: Grouping = Grouping.CONTIGUOUS) -> tuple[dict, dict]:
    """method: a methods.MethodSpec; roles: canonical roles of one layer; ctx: methods.LayerContext."""
    report: dict = {}
    shape = ctx.shape
    if grouping == Grouping.SIMILARITY and ctx.groups > 1:  # with one group every order is the same
        order = similarity_order(
            roles, ctx.stats.gram.double(), shape.kv_heads, ctx.groups, shape.head_dim, ctx.stats.rotary_dims
        )
        roles = permute_heads(roles, order, shape.kv_heads, shape.head_dim)
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
