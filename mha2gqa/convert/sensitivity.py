"""How much each layer loses at each kv-head count, measured in one pass over a few calibration blocks: the loss
of (layer i, count g) is KL(parent || model) per token, the model being the parent with only layer i converted to
g kv heads by the conversion's own merge (LayerMerge: mean-pooling, or the calibrated merge with its maps folded
into q_proj/o_proj, ...). --kv-budget (kv_budget.py) sums these per layer: the usual additive sensitivity of
mixed-precision quantisation, here measured on the model's output rather than a layer's own error.

The converted layer keeps the parent's tensor shapes: each merged kv head is repeated over its group's source
heads, which is exactly what the grouped model computes (query head q reads kv head q // (H / g) either way), so
the parent stays loaded once and each candidate is a swap of the layer's projections, restored after.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from mha2gqa.architecture.layouts import AttentionShape, Layout
from mha2gqa.convert.methods import group_heads, group_mean
from mha2gqa.convert.refine.hooks import call_layer, capture_kwargs
from mha2gqa.convert.refine.model import decoder_layers
from mha2gqa.scoring.kl import kl_divergence


def pooled_in_place(rows: torch.Tensor, kv_heads: int, count: int) -> torch.Tensor:
    """(n_kv*hd, *rest) -> the same shape, each group of n_kv / count heads replaced by its mean."""
    grouped = group_heads(rows, kv_heads, count)  # (G, r, hd, *rest)
    return group_mean(grouped).unsqueeze(1).expand_as(grouped).reshape(rows.shape).to(rows.dtype)


def repeated_over_groups(rows: torch.Tensor, count: int, kv_heads: int) -> torch.Tensor:
    """(count*hd, *rest) merged kv heads -> (kv_heads*hd, *rest): each repeated over its group's source heads."""
    per_head = rows.reshape(count, 1, -1, *rows.shape[1:])  # (G, 1, hd, *rest)
    return per_head.expand(count, kv_heads // count, *per_head.shape[2:]).reshape(
        kv_heads * per_head.shape[2], *rows.shape[1:]
    )


@dataclass
class LayerMerge:
    """A layer converted alone by the conversion's merge (`method`, `grouping`, the layer's statistics), in the
    parent's shapes: {(module path, "weight"/"bias"): tensor} of the layer's q/k/v/o projections. None (the
    default): mean-pooling of k and v alone, which needs no statistics. Each (layer, count) is merged once."""

    method: object = None  # a methods.MethodSpec; None: mean-pooling in place
    grouping: object = None
    stats: object = None  # calibration.Statistics (per layer: .layer(i)), for the methods that read them
    seed: int = 0
    _done: dict = field(default_factory=dict)

    def tensors(self, layer_module, layout: Layout, shape: AttentionShape, layer: int, count: int) -> dict:
        if (layer, count) not in self._done:
            self._done[layer, count] = self._merged(layer_module, layout, shape, layer, count)
        return self._done[layer, count]

    def _merged(self, module, layout: Layout, shape: AttentionShape, layer: int, count: int) -> dict:
        paths = {part: getattr(layout, part) for part in "qkvo"}
        params = {
            (path, kind): getattr(module.get_submodule(path), kind)
            for path in paths.values()
            for kind in ("weight", "bias")
            if getattr(module.get_submodule(path), kind) is not None
        }
        if self.method is None:
            return {
                key: pooled_in_place(param.detach(), shape.kv_heads, count)
                for key, param in params.items()
                if key[0] in (layout.k, layout.v)
            }
        from mha2gqa.convert.layer_step import transform_layer
        from mha2gqa.convert.methods import LayerContext

        roles = {f"{part}.{kind}": params[path, kind].detach().float() for part, path in paths.items() for kind in
                 ("weight", "bias") if (path, kind) in params}  # fmt: skip
        context = LayerContext(shape, count, layer, self.seed, self.stats and self.stats.layer(layer))
        merged, _ = transform_layer(self.method, roles, context, self.grouping)
        found = {}
        for part, path in paths.items():
            for kind in ("weight", "bias"):
                if (path, kind) in params:
                    tensor = merged[f"{part}.{kind}"]
                    if part in "kv":
                        tensor = repeated_over_groups(tensor, count, shape.kv_heads)
                    found[path, kind] = tensor.to(params[path, kind].dtype)
        return found


@torch.no_grad()
def layer_losses(
    model,
    layout: Layout,
    blocks: torch.Tensor,
    shape: AttentionShape,
    counts: list[int],
    progress=None,
    scored=None,
    merge: LayerMerge | None = None,
) -> list[dict]:
    """losses[layer][count] for every count in `counts` (divisors of the source's kv heads; the source's own
    count costs 0 and is not run), averaged over the tokens of `blocks` (N, seq_len). `model`: the parent in eval
    mode, its layers and k/v projections found by `layout` as refine finds them; its weights are restored after
    each candidate. The parent runs once per block; a candidate at layer i runs layers i.. only, each called with
    the arguments the model's own forward gave it, from the parent's input to layer i (the layers below are the
    parent's), which halves the work on average. `scored` (N, seq_len - 1), bool: only these
    positions' predictions count (a copy prompt's answer tokens: scoring/copy_prompts.py); None: all. `merge`: how a
    layer is converted (LayerMerge; None: mean-pooled)."""
    merge = merge or LayerMerge()
    pooled_counts = [c for c in counts if c != shape.kv_heads]
    losses = [{shape.kv_heads: 0.0, **{c: 0.0 for c in pooled_counts}} for _ in range(shape.layers)]
    device = next(model.parameters()).device
    layers = decoder_layers(model, layout, shape.layers)
    for n, block in enumerate(blocks):
        ids = block.unsqueeze(0).to(device)
        inputs, kwargs, parent_logits = _parent_pass(model, layers, ids)
        keep = _positions(scored, n, parent_logits)
        for layer in range(shape.layers):
            for count in pooled_counts:
                with _swapped(layers[layer], merge.tensors(layers[layer], layout, shape, layer, count)):
                    logits = _logits_from(model, layers, layer, inputs[layer], kwargs)
                losses[layer][count] += float(kl_divergence(parent_logits[keep], logits[keep])) / len(blocks)
                if progress is not None:
                    progress.update(1)
    return losses


@torch.no_grad()
def placement_losses(
    model, layout: Layout, blocks: torch.Tensor, shape: AttentionShape, placements: list, scored=None, merge=None
) -> list:
    """For each placement (one kv-head count per layer), the KL per token (per scored position) of the parent
    with every layer pooled to its count at once, averaged over `blocks` as layer_losses does: what the layers'
    losses, measured one at a time, add up to in truth. The parent runs once per block."""
    merge = merge or LayerMerge()
    totals = [0.0] * len(placements)
    device = next(model.parameters()).device
    layers = decoder_layers(model, layout, shape.layers)
    for n, block in enumerate(blocks):
        ids = block.unsqueeze(0).to(device)
        parent_logits = model(ids).logits[0, :-1]
        keep = _positions(scored, n, parent_logits)
        for k, counts in enumerate(placements):
            with contextlib.ExitStack() as stack:
                for layer, count in enumerate(counts):
                    if count != shape.kv_heads:
                        merged = merge.tensors(layers[layer], layout, shape, layer, count)
                        stack.enter_context(_swapped(layers[layer], merged))
                logits = model(ids).logits[0, :-1]
            totals[k] += float(kl_divergence(parent_logits[keep], logits[keep])) / len(blocks)
    return totals


def _positions(scored, n: int, logits: torch.Tensor):
    """Block n's scored positions as an index of its logits (every position where `scored` is None)."""
    return slice(None) if scored is None else scored[n].to(logits.device)


def _parent_pass(model, layers: list, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[dict], torch.Tensor]:
    """The parent's forward: the hidden states entering each decoder layer and the other arguments the model
    passes it (masks, rotary tables: a pre-hook on each, as refine's hooks take them), and the logits of every
    position but the last (what predicts a next token within the block)."""
    inputs: list[torch.Tensor] = []
    kwargs: list[dict] = []

    def keep(module, args, given):
        hidden = args[0] if args else given["hidden_states"]
        inputs.append(hidden)
        kwargs.append(capture_kwargs(given, hidden.shape[0]))

    handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in layers]
    try:
        logits = model(ids, use_cache=False).logits[0, :-1]
    finally:
        for handle in handles:
            handle.remove()
    return inputs, kwargs, logits


def _logits_from(model, layers: list, start: int, hidden: torch.Tensor, kwargs: list[dict]) -> torch.Tensor:
    """Layers start.. on `hidden` (1, T, d), each called with the arguments the parent's forward gave it, then the
    final norm and the output head: logits of every position but the last."""
    for index in range(start, len(layers)):
        hidden = call_layer(layers[index], hidden, kwargs[index])
    return model.get_output_embeddings()(model.base_model.norm(hidden))[0, :-1]


class _swapped:
    """Context: a layer's projections replaced by `tensors` ({(module path, "weight"/"bias"): tensor}), restored on
    exit."""

    def __init__(self, layer, tensors: dict):
        self.pairs = [(getattr(layer.get_submodule(path), kind), tensor) for (path, kind), tensor in tensors.items()]

    def __enter__(self):
        self.saved = [param.detach().clone() for param, _ in self.pairs]
        for param, tensor in self.pairs:
            param.copy_(tensor)

    def __exit__(self, *exc):
        for (param, _), saved in zip(self.pairs, self.saved):
            param.copy_(saved)
