"""How many steps a budget buys, and the learning rate at each step (a pure function of the step,
so that a resumed run needs no scheduler state to continue exactly)."""

from __future__ import annotations

import math

from mha2gqa.uptrain.recipe import OptimConfig, Recipe


def tokens_per_step(recipe: Recipe, world_size: int) -> int:
    """Tokens in one optimizer step over all processes (packed blocks: no padding to discount)."""
    return recipe.seq_len * recipe.micro_batch_size * recipe.grad_accum * world_size


def total_steps(recipe: Recipe, world_size: int) -> int:
    """Optimizer steps the budget allows; a token budget rounds up to whole steps."""
    b = recipe.budget
    if b.max_steps is not None:
        return b.max_steps
    tokens = b.tokens if b.tokens is not None else b.alpha * b.pretrain_tokens
    return max(1, math.ceil(tokens / tokens_per_step(recipe, world_size)))


def lr_at(step: int, total: int, optim: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total`: linear warmup, then decay."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    floor = optim.lr * optim.min_lr_ratio
    span = max(1, total - 1 - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    if optim.schedule == "cosine":
        return floor + (optim.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if optim.schedule == "linear":
        return optim.lr - (optim.lr - floor) * progress
    return optim.lr
