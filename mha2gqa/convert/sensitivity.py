"""How much each layer loses at each kv-head count, measured in one pass over a few calibration blocks: the loss
of (layer i, count g) is KL(parent || model) per token, the model being the parent with only layer i's keys and
values mean-pooled to g heads. --kv-budget (kv_budget.py) sums these per layer: the usual additive sensitivity
of mixed-precision quantisation, here measured on the model's output rather than a layer's own error.

The pooled layer keeps its tensors' shapes: each group's mean is repeated over the group's source heads, which
is exactly what the grouped model computes (query head q reads kv head q // (H / g) either way), so the parent
stays loaded once and each candidate is a swap of two (or four, with biases) tensors.
"""

from __future__ import annotations

import contextlib

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


@torch.no_grad()
def layer_losses(
    model,
    layout: Layout,
    blocks: torch.Tensor,
    shape: AttentionShape,
    counts: list[int],
    progress=None,
    scored=None,
) -> list[dict]:
    """losses[layer][count] for every count in `counts` (divisors of the source's kv heads; the source's own
    count costs 0 and is not run), averaged over the tokens of `blocks` (N, seq_len). `model`: the parent in eval
    mode, its layers and k/v projections found by `layout` as refine finds them; its weights are restored after
    each candidate. The parent runs once per block; a candidate at layer i runs layers i.. only, each called with
    the arguments the model's own forward gave it, from the parent's input to layer i (the layers below are the
    parent's), which halves the work on average. `scored` (N, seq_len - 1), bool: only these
    positions' predictions count (a copy prompt's answer tokens: scoring/copy_prompts.py); None: all."""
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
                with _pooled(layers[layer], layout, shape.kv_heads, count):
                    logits = _logits_from(model, layers, layer, inputs[layer], kwargs)
                losses[layer][count] += float(kl_divergence(parent_logits[keep], logits[keep])) / len(blocks)
                if progress is not None:
                    progress.update(1)
    return losses


@torch.no_grad()
def placement_losses(
    model, layout: Layout, blocks: torch.Tensor, shape: AttentionShape, placements: list, scored=None
) -> list:
    """For each placement (one kv-head count per layer), the KL per token (per scored position) of the parent
    with every layer pooled to its count at once, averaged over `blocks` as layer_losses does: what the layers'
    losses, measured one at a time, add up to in truth. The parent runs once per block."""
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
                        stack.enter_context(_pooled(layers[layer], layout, shape.kv_heads, count))
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


class _pooled:
    """Context: a layer's k/v projections (weights and biases, found by the layout) pooled to `count` heads,
    restored on exit."""

    def __init__(self, layer, layout: Layout, kv_heads: int, count: int):
        self.params = [
            param
            for name in (layout.k, layout.v)
            for param in (layer.get_submodule(name).weight, layer.get_submodule(name).bias)
            if param is not None
        ]
        self.kv_heads, self.count = kv_heads, count

    def __enter__(self):
        self.saved = [param.detach().clone() for param in self.params]
        for param in self.params:
            param.copy_(pooled_in_place(param.detach(), self.kv_heads, self.count))

    def __exit__(self, *exc):
        for param, saved in zip(self.params, self.saved):
            param.copy_(saved)
