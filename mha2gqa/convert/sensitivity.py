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

from mha2gqa.architecture.layouts import AttentionShape
from mha2gqa.convert.methods import group_heads, group_mean
from mha2gqa.scoring.kl import kl_divergence

KV_MODULES = ("k_proj", "v_proj")


def pooled_in_place(rows: torch.Tensor, kv_heads: int, count: int) -> torch.Tensor:
    """(n_kv*hd, *rest) -> the same shape, each group of n_kv / count heads replaced by its mean."""
    grouped = group_heads(rows, kv_heads, count)  # (G, r, hd, *rest)
    return group_mean(grouped).unsqueeze(1).expand_as(grouped).reshape(rows.shape).to(rows.dtype)


@torch.no_grad()
def layer_losses(
    model, blocks: torch.Tensor, shape: AttentionShape, counts: list[int], progress=None, scored=None
) -> list[dict]:
    """losses[layer][count] for every count in `counts` (divisors of the source's kv heads; the source's own
    count costs 0 and is not run), averaged over the tokens of `blocks` (N, seq_len). `model`: the parent, a
    Llama-family transformers model in eval mode; its weights are restored after each candidate. The parent runs
    once per block; a candidate at layer i runs layers i.. only, from the parent's input to layer i (the layers
    below are the parent's), which halves the work on average. `scored` (N, seq_len - 1), bool: only these
    positions' predictions count (a copy prompt's answer tokens: scoring/copy_prompts.py); None: all."""
    pooled_counts = [c for c in counts if c != shape.kv_heads]
    losses = [{shape.kv_heads: 0.0, **{c: 0.0 for c in pooled_counts}} for _ in range(shape.layers)]
    device = next(model.parameters()).device
    for n, block in enumerate(blocks):
        ids = block.unsqueeze(0).to(device)
        inputs, parent_logits = _parent_pass(model, ids)
        keep = _positions(scored, n, parent_logits)
        for layer in range(shape.layers):
            for count in pooled_counts:
                with _pooled(model, layer, shape.kv_heads, count):
                    logits = _logits_from(model, layer, inputs[layer])
                losses[layer][count] += float(kl_divergence(parent_logits[keep], logits[keep])) / len(blocks)
                if progress is not None:
                    progress.update(1)
    return losses


@torch.no_grad()
def placement_losses(model, blocks: torch.Tensor, shape: AttentionShape, placements: list, scored=None) -> list:
    """For each placement (one kv-head count per layer), the KL per token (per scored position) of the parent
    with every layer pooled to its count at once, averaged over `blocks` as layer_losses does: what the layers'
    losses, measured one at a time, add up to in truth. The parent runs once per block."""
    totals = [0.0] * len(placements)
    device = next(model.parameters()).device
    for n, block in enumerate(blocks):
        ids = block.unsqueeze(0).to(device)
        parent_logits = model(ids).logits[0, :-1]
        keep = _positions(scored, n, parent_logits)
        for k, counts in enumerate(placements):
            with contextlib.ExitStack() as stack:
                for layer, count in enumerate(counts):
                    if count != shape.kv_heads:
                        stack.enter_context(_pooled(model, layer, shape.kv_heads, count))
                logits = model(ids).logits[0, :-1]
            totals[k] += float(kl_divergence(parent_logits[keep], logits[keep])) / len(blocks)
    return totals


def _positions(scored, n: int, logits: torch.Tensor):
    """Block n's scored positions as an index of its logits (every position where `scored` is None)."""
    return slice(None) if scored is None else scored[n].to(logits.device)


def _parent_pass(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The parent's forward: the hidden states entering each decoder layer (a pre-hook on each), and the logits
    of every position but the last (what predicts a next token within the block)."""
    inputs: list[torch.Tensor] = []

    def keep(module, args, kwargs):
        inputs.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in model.model.layers]
    try:
        logits = model(ids).logits[0, :-1]
    finally:
        for handle in handles:
            handle.remove()
    return inputs, logits


def _logits_from(model, start: int, hidden: torch.Tensor) -> torch.Tensor:
    """Layers start.. of a Llama-family model on `hidden` (1, T, d), its causal mask and rotary embedding as its
    own forward makes them, then the final norm and the head: logits of every position but the last."""
    from transformers.masking_utils import create_causal_mask

    base = model.model
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(
        config=base.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
    )
    rotary = base.rotary_emb(hidden, position_ids=positions)
    for layer in base.layers[start:]:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
    return model.lm_head(base.norm(hidden))[0, :-1]


class _pooled:
    """Context: layer `layer`'s k/v projections (weights and biases) pooled to `count` heads, restored on exit."""

    def __init__(self, model, layer: int, kv_heads: int, count: int):
        attention = model.model.layers[layer].self_attn
        self.params = [
            param
            for name in KV_MODULES
            for param in (getattr(attention, name).weight, getattr(attention, name).bias)
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
