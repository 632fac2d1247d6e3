"""The global stage of `--refine` (`--refine-global-steps`, 64 by default; 0: off): after the layer-wise
stages, the parameters they refined, in every layer together, are fitted to the parent's next-token
distribution (KL(parent || converted), mean over tokens) on the fit blocks.

Why: the layer-wise stages match each layer's output to the parent's, but weigh every direction of the
residual stream alike; the KL weighs them by what the output distribution cares about, and fits all
layers jointly, so one layer may leave an error that a later one cancels.

Bounded: `steps` Adam steps, the held-out KL measured every `heldout_every` steps, the best parameters
kept, and an early stop after `patience` checks without improvement, so a run never ends worse on the
held-out blocks than it started (the start is the first check). The optimizer is uptraining's: a linear
warmup over the first tenth, then a constant lr, betas (0.9, 0.95), the gradient norm clipped to 1.
Measured on SmolLM2 (docs/refine.md): a cosine decay to 0 halves what a short run learns, and unclipped
steps of lr 3e-4 raised the held-out KL from 0.37 to 0.43 by step 5.

Cost: per step one parent forward and one converted forward + backward of `batch_blocks` blocks, one
block at a time (memory: both models, the gradients and Adam state of the trained parameters, and one
block's activations through the whole model; the parent's logits on the fit blocks are computed per step,
not stored). A check runs the converted model over the held-out blocks and openings; the parent's logits
there never change, so they are computed at the first check and kept (ParentTargets) when they fit the
--refine-memory budget: on SmolLM2 the parent's forwards were ~45% of a check.
Parameters held in bfloat16 or float16 (a --dtype cast, a GPU run) are trained through float32 master
copies: an update of lr 1e-4 is below bfloat16's resolution for most weights and would round away.
The fit steps' forwards and backward run in bfloat16 autocast where it pays (precision.py,
--refine-global-precision, decided by convert's plan); the checks stay float32, so the step kept is chosen
by the same measure anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mha2gqa.convert.inputs import GLOBAL_HELDOUT_EVERY, OPENINGS_PER_STEP, heldout_targets_bytes
from mha2gqa.convert.options import RefineOptions
from mha2gqa.convert.refine.buffers import Openings, mini_batches
from mha2gqa.convert.refine.precision import fit_autocast_dtype
from mha2gqa.runtime.progress import progress_bar
from mha2gqa.scoring.kl import kl_divergence


@dataclass(frozen=True)
class GlobalFit:
    """The global stage's settings: `--refine-global-steps`, `--refine-global-lr` and --refine's batch of
    blocks (GlobalFit.of(options)); the rest are fixed by measurement (docs/refine.md) and varied only by
    bench/refine_global_real.py."""

    steps: int
    lr: float
    batch_blocks: int = 4
    heldout_every: int = GLOBAL_HELDOUT_EVERY
    patience: int = 2
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    decay: bool = False
    autocast: torch.dtype | None = None  # the fit steps' autocast dtype; None: float32

    @classmethod
    def of(cls, options: RefineOptions) -> GlobalFit:
        autocast = fit_autocast_dtype(options.global_precision)  # the plan's explicit choice (convert/decide.py)
        return cls(options.global_steps, options.global_lr, options.batch_blocks, autocast=autocast)


class ParentTargets:
    """The parent's logits on the held-out blocks and openings, for heldout_kl: computed by the first check and
    kept on the CPU when all of them fit `memory` bytes (else computed again at each check, as before). The same
    float32 logits either way, so a check's KL does not depend on whether they were kept."""

    def __init__(self, parent, memory: int):
        self.parent, self.memory = parent, memory
        self.positions = 0  # the held-out positions a check scores (heldout_kl sets it)
        self.kept: dict[tuple[str, int], torch.Tensor] = {}
        self.keep: bool | None = None  # decided by the first logits, from their vocabulary

    def logits(self, key: tuple[str, int], ids: torch.Tensor) -> torch.Tensor:
        if key in self.kept:
            return self.kept[key].to(ids.device)
        found = self.parent(ids, use_cache=False).logits
        if self.keep is None:
            self.keep = heldout_targets_bytes(self.positions, found.shape[-1]) <= self.memory
        if self.keep:
            self.kept[key] = found.float().cpu()
        return found


def heldout_kl(
    parent, model, blocks: torch.Tensor, heldout: torch.Tensor, openings: Openings | None = None, targets=None
) -> float:
    """The mean KL over the held-out blocks, plus the mean over the held-out openings times their weight when
    given: the measure that picks the best step sees the first positions the blocks alone would not
    (buffers.Openings). `targets`: a ParentTargets of `parent`, which keeps the parent's logits between checks."""
    device = next(model.parameters()).device
    targets = targets or ParentTargets(parent, memory=0)
    opening_rows = [] if openings is None else list(openings.split["heldout"].split(OPENINGS_PER_STEP))
    held_openings = 0 if openings is None else len(openings.split["heldout"]) * openings.ids.shape[1]
    targets.positions = len(heldout) * blocks.shape[1] + held_openings
    total = 0.0
    with torch.no_grad():
        for index in heldout.tolist():
            block = blocks[index : index + 1].to(device)
            parent_logits = targets.logits(("block", index), block)
            total += float(kl_divergence(parent_logits, model(block, use_cache=False).logits))
        opening_kl = 0.0
        if openings is not None:
            # OPENINGS_PER_STEP rows at a time, as a fit step takes them: the logits of all the held-out openings
            # at once, and the KL's vocabulary-wide terms, grew with --refine-tokens (7 x 226 MB at SmolLM2's
            # 144 held-out openings of 73,728 tokens) past the peak the plan estimates.
            kl_sum, positions = 0.0, 0
            for number, chunk in enumerate(opening_rows):
                rows = openings.ids[chunk].to(device)
                parent_logits = targets.logits(("openings", number), rows)
                per_position = kl_divergence(parent_logits, model(rows, use_cache=False).logits, reduction="none")
                kl_sum, positions = kl_sum + float(per_position.sum()), positions + per_position.numel()
            opening_kl = openings.weight * kl_sum / positions
    return total / len(heldout) + opening_kl


def fit_global(
    parent,
    model,
    params: list[torch.nn.Parameter],
    blocks: torch.Tensor,
    split: dict,
    fit: GlobalFit,
    generator: torch.Generator,
    progress: bool = True,
    openings: Openings | None = None,
    memory: int = 0,
) -> dict:
    """Adam on `params` (of `model`) against the parent's distribution on blocks[split['fit']] (and on a batch
    of the fit openings each step, when given); the best held-out parameters are left in place. Returns the
    record: per check the step, fit and held-out KL. `memory`: the most bytes the parent's held-out logits may take
    to be kept between checks (ParentTargets)."""
    for p in params:
        p.requires_grad_(True)
    # What Adam updates: the parameters themselves when float32, else float32 copies written back each step.
    masters = [p if p.dtype == torch.float32 else p.detach().float() for p in params]
    optimizer = torch.optim.Adam(masters, lr=fit.lr, betas=fit.betas)
    warmup = max(1, fit.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * s / fit.steps)) if fit.decay else 1),
    )
    heldout, targets = split["heldout"], ParentTargets(parent, memory)
    checks = [{"step": 0, "heldout_kl": heldout_kl(parent, model, blocks, heldout, openings, targets)}]
    best, stale = (checks[0]["heldout_kl"], [m.detach().clone() for m in masters]), 0
    batches = mini_batches(split["fit"], fit.batch_blocks, generator)
    opening_batches = None if openings is None else mini_batches(openings.split["fit"], openings.per_step, generator)
    bar = progress_bar(fit.steps, "refine all layers", progress, range(1, fit.steps + 1), unit="step", leave=False)
    try:
        for step in bar:
            optimizer.zero_grad(set_to_none=True)
            fit_kl = _kl_gradients(parent, model, blocks, next(batches), autocast=fit.autocast)
            if opening_batches is not None:
                rows, weight = next(opening_batches), openings.weight
                fit_kl += _kl_gradients(parent, model, openings.ids, rows, True, weight, fit.autocast)
            if fit.clip:
                torch.nn.utils.clip_grad_norm_(params, fit.clip)
            _step(optimizer, params, masters)
            schedule.step()
            bar.set_postfix(kl=f"{fit_kl:.4f}", refresh=False)
            if step % fit.heldout_every == 0 or step == fit.steps:
                held = heldout_kl(parent, model, blocks, heldout, openings, targets)
                checks.append({"step": step, "fit_kl": fit_kl, "heldout_kl": held})
                if checks[-1]["heldout_kl"] < best[0]:
                    best, stale = (checks[-1]["heldout_kl"], [m.detach().clone() for m in masters]), 0
                else:
                    stale += 1
                    if stale == fit.patience:
                        break  # `patience` checks in a row without a better held-out KL
    finally:
        bar.close()
        _keep(params, best[1])
    return _record(fit, checks, best[0]) | {"parent_logits_kept": bool(targets.keep)}


def _kl_gradients(
    parent,
    model,
    blocks: torch.Tensor,
    chunk: torch.Tensor,
    together: bool = False,
    scale: float = 1.0,
    autocast: torch.dtype | None = None,
) -> float:
    """Accumulate the gradients of `scale` x the mean KL over the sequences `chunk` of `blocks`, one at a time so
    that only one block's activations are held (`together`: all in one forward, for short sequences); returns that
    scaled mean KL. `autocast`: the dtype both models' forwards run in (the KL itself is float32, kl.py)."""
    device = next(model.parameters()).device
    fit_kl = 0.0
    for rows in [chunk] if together else chunk.split(1):
        ids = blocks[rows].to(device)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            with torch.no_grad():
                target = parent(ids, use_cache=False).logits
            loss = kl_divergence(target, model(ids, use_cache=False).logits) * (scale * len(rows)) / len(chunk)
        loss.backward()
        fit_kl += loss.item()
    return fit_kl


def _keep(params: list[torch.nn.Parameter], kept: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, saved in zip(params, kept, strict=True):
            p.copy_(saved)
            p.requires_grad_(False)


def _record(fit: GlobalFit, checks: list[dict], best: float) -> dict:
    return {
        "steps": fit.steps,
        "lr": fit.lr,
        "batch_blocks": fit.batch_blocks,
        "betas": list(fit.betas),
        "clip": fit.clip,
        "decay": fit.decay,
        "check_every": fit.heldout_every,
        "precision": "float32" if fit.autocast is None else f"{str(fit.autocast).removeprefix('torch.')} autocast",
        "checks": checks,
        "best_step": next(c["step"] for c in checks if c["heldout_kl"] == best),
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
