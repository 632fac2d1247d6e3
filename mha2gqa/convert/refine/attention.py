"""The attention fit of `--refine` (chosen by measurement, docs/refine.md): Adam on the normalised MSE
||attn(x) - t||^2 / mean ||t||^2 over seeded mini-batches of blocks, cosine-decayed learning rate, then a
closed-form least-squares solve of o_proj given the rest, and the relative error every layer's report uses."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from mha2gqa.architecture.layouts import Layout
from mha2gqa.convert.options import RefineOptions
from mha2gqa.convert.refine.buffers import mini_batches
from mha2gqa.convert.refine.hooks import attention_output

EXACT = 1e-10  # relative output error treated as exact


def relative(errors: torch.Tensor, power: torch.Tensor, blocks: torch.Tensor) -> float:
    """sum ||out - t||^2 / sum ||t||^2 over `blocks`, from per-block sums."""
    total = float(power[blocks].sum())
    return float(errors[blocks].sum()) / total if total > 0 else 0.0


def _ridge_solve(gram: torch.Tensor, cross: torch.Tensor) -> torch.Tensor:
    """argmin_W ||A W - T||^2 from the normal equations (gram = A^T A, cross = A^T T, float64), with a tiny
    ridge (1e-6 of the mean diagonal) so that an input direction the tokens never use stays finite."""
    width = len(gram)
    ridge = 1e-6 * gram.diagonal().mean() * torch.eye(width, dtype=torch.float64, device=gram.device)
    return torch.linalg.solve(gram + ridge, cross)  # (width, out)


@dataclass
class Side:
    """A second set of sequences fitted beside the blocks (the openings, buffers.Openings): its attention keyword
    arguments (its own length), the converted inputs and the parent's targets, the fit indices, and how many
    join each Adam step. Each set's loss is normalised by its own mean power, and the side's is added to the
    blocks' times `weight`."""

    kwargs: dict
    inputs: torch.Tensor
    targets: torch.Tensor
    fit: torch.Tensor
    per_step: int
    weight: float = 1.0


def fit_attention(
    attn,
    layout: Layout,
    kwargs: dict,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    fit: torch.Tensor,
    options: RefineOptions,
    generator: torch.Generator,
    index: int = 0,
    bar=None,
    side: Side | None = None,
) -> None:
    """Fit `attn`'s parameters so that attn(inputs) ~= targets on the blocks `fit` (and on `side`'s sequences,
    when given): Adam, then the closed-form o_proj. Runs in float32 whatever the checkpoint's dtype.
    bar: the overall progress bar, advanced one step per Adam step."""
    dtype = next(attn.parameters()).dtype
    attn.float()
    # each set's mean power, read once: Adam's loss and the o_proj solve weigh the sets by the same numbers
    side_power = None if side is None else _power(side.targets, side.fit, side.per_step)
    powers = (_power(targets, fit, options.batch_blocks), side_power)
    _adam(attn, kwargs, inputs, targets, fit, options, generator, bar, side, powers)
    if options.solve_output:
        _solve_output(attn, layout, kwargs, inputs, targets, fit, options.batch_blocks, side, powers)
    attn.to(dtype)


def _power(targets: torch.Tensor, fit: torch.Tensor, batch: int) -> float:
    """Mean ||t||^2 per token of the `fit` sequences: what makes a loss scale-free."""
    total = sum(targets[chunk].double().pow(2).mean(-1).sum() for chunk in fit.split(batch))
    return float(total / (len(fit) * targets.shape[1]))


def _adam(attn, kwargs, inputs, targets, fit, options: RefineOptions, generator, bar, side, powers) -> None:
    if options.steps == 0:
        return
    device = next(attn.parameters()).device
    params = [p for p in attn.parameters()]
    for p in params:
        p.requires_grad_(True)
    power, side_power = powers
    if side is not None:
        side_batches = mini_batches(side.fit, side.per_step, generator)
    optimizer = torch.optim.Adam(params, lr=options.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / options.steps)))
    width = targets.shape[-1]
    try:
        for chunk in itertools.islice(mini_batches(fit, options.batch_blocks, generator), options.steps):
            x, t = inputs[chunk].to(device), targets[chunk].to(device)
            loss = (attention_output(attn, x, kwargs) - t).pow(2).sum(-1).mean() / power
            if side is not None:
                rows = next(side_batches)
                x, t = side.inputs[rows].to(device), side.targets[rows].to(device)
                side_loss = (attention_output(attn, x, side.kwargs) - t).pow(2).sum(-1).mean() / side_power
                loss = loss + side.weight * side_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            if bar is not None:
                # The loss sums the error over hidden and divides by the mean power per hidden unit: divided
                # by the width it is the relative error of this batch (plus the side's), as the per-layer table.
                bar.set_postfix(error=f"{loss.item() / width:.4f}", refresh=False)
                bar.update(1)
    finally:
        for p in params:
            p.requires_grad_(False)


def _solve_output(attn, layout: Layout, kwargs, inputs, targets, fit, batch_blocks: int, side, powers) -> None:
    """o_proj (and its bias, when it has one) by least squares given everything before it: accumulate
    A^T A and A^T T over the fit blocks (A: o_proj's input Z, with a ones column for the bias), and over the
    side's sequences weighted as the Adam loss weighs them (each set by its tokens and mean power), solve
    in float64 with a tiny ridge."""
    o_proj = attn.get_submodule(layout.o.rsplit(".", 1)[1])
    device, has_bias = o_proj.weight.device, o_proj.bias is not None
    width = o_proj.weight.shape[1] + has_bias
    gram = torch.zeros(width, width, dtype=torch.float64, device=device)
    cross = torch.zeros(width, o_proj.weight.shape[0], dtype=torch.float64, device=device)
    current = {}
    handle = o_proj.register_forward_pre_hook(lambda module, args: current.update(z=args[0]))

    def accumulate(x, t, call_kwargs, weight: float) -> None:
        nonlocal gram, cross
        attention_output(attn, x.to(device), call_kwargs)
        a = current["z"].reshape(-1, o_proj.weight.shape[1]).double()  # (N, H*hd)
        if has_bias:
            a = torch.cat([a, a.new_ones(len(a), 1)], dim=1)
        gram += weight * (a.T @ a)
        cross += weight * (a.T @ t.to(device).reshape(len(a), -1).double())

    try:
        with torch.no_grad():
            for chunk in fit.split(batch_blocks):
                accumulate(inputs[chunk], targets[chunk], kwargs, 1.0)
            if side is not None and side.weight > 0:
                # rows weighted side.weight x (tokens x power of the blocks) / (tokens x power of the side)
                block_mass = len(fit) * targets.shape[1] * powers[0]
                side_mass = len(side.fit) * side.targets.shape[1] * powers[1]
                weight = side.weight * block_mass / side_mass if side_mass > 0 else 0.0
                for rows in side.fit.split(side.per_step):
                    accumulate(side.inputs[rows], side.targets[rows], side.kwargs, weight)
    finally:
        handle.remove()
    solution = _ridge_solve(gram, cross)  # (width, d)
    with torch.no_grad():
        o_proj.weight.copy_(solution[: o_proj.weight.shape[1]].T)
        if has_bias:
            o_proj.bias.copy_(solution[-1])
