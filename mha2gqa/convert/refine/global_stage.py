"""The global stage of `--refine` (`--refine-global-steps`, 24 by default; 0: off): after the layer-wise
stages, the parameters they refined, in every layer together, are fitted to the parent's next-token
distribution (KL(parent || converted), mean over tokens) on the fit blocks.

Why: the layer-wise stages match each layer's output to the parent's, but weigh every direction of the
residual stream alike; the KL weighs them by what the output distribution cares about, and fits all
layers jointly, so one layer may leave an error that a later one cancels.

Bounded: `steps` Adam steps, the held-out KL measured every `check_every` steps, the best parameters
kept, and an early stop after `patience` checks without improvement, so a run never ends worse on the
held-out blocks than it started (the start is the first check). The optimizer is uptraining's: a linear
warmup over the first tenth, then a constant lr, betas (0.9, 0.95), the gradient norm clipped to 1.
Measured on SmolLM2 (docs/refine.md): a cosine decay to 0 halves what a short run learns, and unclipped
steps of lr 3e-4 raised the held-out KL from 0.37 to 0.43 by step 5.

Cost: per step one parent forward and one converted forward + backward of `batch_blocks` blocks, one
block at a time (memory: both models, the gradients and Adam state of the trained parameters, and one
block's activations through the whole model; the parent's logits are computed per step, not stored).
Parameters held in bfloat16 or float16 (a --dtype cast, a GPU run) are trained through float32 master
copies: an update of lr 1e-4 is below bfloat16's resolution for most weights and would round away.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm


def kl_divergence(parent_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(parent || model), in float32 whatever the models' dtype."""
    target = parent_logits.float().log_softmax(-1)
    return (target.exp() * (target - logits.float().log_softmax(-1))).sum(-1).mean()


def heldout_kl(parent, model, blocks: torch.Tensor, heldout: torch.Tensor) -> float:
    device = next(model.parameters()).device
    total = 0.0
    with torch.no_grad():
        for index in heldout.tolist():
            block = blocks[index : index + 1].to(device)
            total += float(kl_divergence(parent(block, use_cache=False).logits, model(block, use_cache=False).logits))
    return total / len(heldout)


def fit_global(
    parent,
    model,
    params: list[torch.nn.Parameter],
    blocks: torch.Tensor,
    split: dict,
    steps: int,
    lr: float,
    batch_blocks: int,
    generator: torch.Generator,
    check_every: int = 5,
    patience: int = 2,
    progress: bool = True,
    betas: tuple[float, float] = (0.9, 0.95),
    clip: float = 1.0,
    decay: bool = False,
) -> dict:
    """Adam on `params` (of `model`) against the parent's distribution on blocks[split['fit']]; the best
    held-out parameters are left in place. Returns the record: per check the step, fit and held-out KL."""
    device = next(model.parameters()).device
    for p in params:
        p.requires_grad_(True)
    # What Adam updates: the parameters themselves when float32, else float32 copies written back each step.
    masters = [p if p.dtype == torch.float32 else p.detach().float() for p in params]
    optimizer = torch.optim.Adam(masters, lr=lr, betas=betas)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * s / steps)) if decay else 1)
    )
    fit, heldout = split["fit"], split["heldout"]
    checks = [{"step": 0, "heldout_kl": heldout_kl(parent, model, blocks, heldout)}]
    best, stale = (checks[0]["heldout_kl"], [m.detach().clone() for m in masters]), 0
    order = torch.empty(0, dtype=torch.long)
    bar = tqdm(range(1, steps + 1), desc="refine all layers", unit="step", disable=not progress, leave=False)
    try:
        for step in bar:
            if len(order) < min(batch_blocks, len(fit)):  # epochs of a seeded permutation
                order = torch.cat([order, fit[torch.randperm(len(fit), generator=generator)]])
            chunk, order = order[:batch_blocks], order[batch_blocks:]
            optimizer.zero_grad(set_to_none=True)
            fit_kl = 0.0
            for index in chunk.tolist():  # one block at a time: activations of one block only
                block = blocks[index : index + 1].to(device)
                with torch.no_grad():
                    target = parent(block, use_cache=False).logits
                loss = kl_divergence(target, model(block, use_cache=False).logits) / len(chunk)
                loss.backward()
                fit_kl += loss.item()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            _step(optimizer, params, masters)
            schedule.step()
            bar.set_postfix(kl=f"{fit_kl:.4f}", refresh=False)
            if step % check_every == 0 or step == steps:
                checks.append(
                    {"step": step, "fit_kl": fit_kl, "heldout_kl": heldout_kl(parent, model, blocks, heldout)}
                )
                if checks[-1]["heldout_kl"] < best[0]:
                    best, stale = (checks[-1]["heldout_kl"], [m.detach().clone() for m in masters]), 0
                else:
                    stale += 1
                    if stale == patience:
                        break  # `patience` checks in a row without a better held-out KL
    finally:
        bar.close()
        with torch.no_grad():
            for p, kept in zip(params, best[1], strict=True):
                p.copy_(kept)
                p.requires_grad_(False)
    best_step = next(c["step"] for c in checks if c["heldout_kl"] == best[0])
    return {
        "steps": steps,
        "lr": lr,
        "batch_blocks": batch_blocks,
        "betas": list(betas),
        "clip": clip,
        "decay": decay,
        "checks": checks,
        "best_step": best_step,
    }


def _step(optimizer, params: list[torch.nn.Parameter], masters: list[torch.Tensor]) -> None:
    """One Adam step on the float32 masters, from the parameters' gradients, written back to the parameters."""
    for p, m in zip(params, masters, strict=True):
        if m is not p:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
    optimizer.step()
    with torch.no_grad():
        for p, m in zip(params, masters, strict=True):
            if m is not p:
                p.copy_(m)
