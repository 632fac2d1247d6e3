"""What stops a run that is going wrong before it saves anything: a non-finite or spiking loss, weights that
grew out of all proportion, an eval no better than guessing (Guard), and the message that says so
(TrainingDiverged). The step loop (steps.py) asks these after every step and eval; a checkpoint is saved
only after its weights passed."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mha2gqa.uptrain import checkpoints


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf, the loss jumped far above its running level, or an
    eval fell to guessing: the step was not applied and nothing more was saved."""


# A step loss this many times its running level (and at least SPIKE_NATS above it) is divergence:
# ordinary loss noise stays well inside it, a destroyed model (loss near or above log vocab) does not.
SPIKE_RATIO, SPIKE_NATS, SPIKE_AFTER = 3.0, 1.0, 3
# An eval loss within GUESS_MARGIN nats of log(vocab_size) is guessing: evals of the same weights on
# the same blocks agree far closer than that, and one step of lr=1e30 landed 2e-6 below log(4096).
GUESS_MARGIN = 0.1
# Weights whose largest |value| grew this many times since the run (or its resume) began are
# destroyed, whatever the loss says: norms start at 1, trained weights stay within a few of it.
WEIGHT_GROWTH = 1000.0


class Guard:
    """Divergence that a finite loss hides. A destructive update (optim.lr=1e6, say) gives finite
    losses for a step or two before the NaN; a checkpoint saved in between would be "the last good"
    one and poison every --resume. So a checkpoint or final model is saved only after an eval of the
    weights it holds passes `eval_problem`, and each step's loss is compared with its running level."""

    def __init__(self, vocab_size: int, best_eval: float | None = None, weight_scale: float | None = None):
        self.uniform = math.log(vocab_size)  # the loss of guessing uniformly over the vocabulary
        self.vocab_size = vocab_size
        self.weight_scale = weight_scale  # the largest |weight| when the run (or its resume) began
        self.best_eval = best_eval
        self.level: float | None = None  # running (EMA) level of the step loss
        self.steps = 0

    def step_problem(self, loss: float) -> str | None:
        if self.steps >= SPIKE_AFTER and loss > SPIKE_RATIO * self.level and loss - self.level > SPIKE_NATS:
            return f"loss {loss:.4g} jumped above {SPIKE_RATIO:g}x its running level {self.level:.4g}"
        self.level = loss if self.level is None else 0.9 * self.level + 0.1 * loss
        self.steps += 1
        return None

    def eval_problem(self, eval_loss: float, weight_scale: float | None = None) -> str | None:
        """Why weights that evaluate to `eval_loss` (largest |weight| `weight_scale`) are not good, or None."""
        if not math.isfinite(eval_loss):
            return f"eval loss {eval_loss}"
        started_finite = self.weight_scale is not None and math.isfinite(self.weight_scale)
        if started_finite and weight_scale is not None and not math.isfinite(weight_scale):
            return f"weights hold non-finite values (max |w| {weight_scale})"  # a source's own NaN is not ours
        if self.weight_scale and weight_scale is not None and weight_scale > WEIGHT_GROWTH * self.weight_scale:
            return (
                f"the largest |weight| grew from {self.weight_scale:.3g} to {weight_scale:.3g} "
                f"(over {WEIGHT_GROWTH:g}x)"
            )
        # A run that had been better than guessing and is now no better, by a margin noise cannot cross,
        # has destroyed the model (a model trained from scratch may start at guessing: that alone is not
        # divergence).
        guessing = self.uniform - GUESS_MARGIN
        if self.best_eval is not None and self.best_eval < guessing <= eval_loss:
            return (
                f"eval loss {eval_loss:.7g} is no better than guessing (log vocab_size {self.vocab_size} = "
                f"{self.uniform:.7g}, within {GUESS_MARGIN:g} nats; this run had reached {self.best_eval:.4g})"
            )
        self.best_eval = eval_loss if self.best_eval is None else min(self.best_eval, eval_loss)
        return None


def finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def weight_scale(model: torch.nn.Module, accelerator) -> float:
    """The largest |value| of any weight, over every rank's parameters (the same number on each)."""
    with torch.no_grad():  # torch's max, not Python's: a NaN anywhere must come out as NaN
        shards = [_own_shard(p.detach()) for p in model.parameters()]
        peaks = [shard.abs().max().float() for shard in shards if shard.numel()]
        local = torch.stack(peaks).max().reshape(1) if peaks else torch.zeros(1)
    return float(accelerator.gather(local.to(accelerator.device)).max())


def _own_shard(parameter: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds, as a plain tensor. FSDP2 keeps each parameter as a DTensor:
    a reduction over it is a DTensor too, and accelerate's gather of one fails (no sharding strategy for
    all_gather); the gather below already takes the max over the ranks' shards."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def diverged_message(out: Path, step: int, what: str, lr: float, applied: bool = False) -> str:
    """What TrainingDiverged says: what went wrong at which step, what was kept, and how to go on."""
    found = checkpoints.complete_checkpoints(out)
    done = "The weights were not saved" if applied else "The step was not applied"
    fix = "Lower optim.lr or raise optim.warmup_steps (or use bf16 instead of fp16)"
    if found:
        return (
            f"training diverged at step {step}: {what}, lr {lr:.3g}. {done}; the last good checkpoint is "
            f"{found[-1]}. {fix}, then continue with --resume or start over"
        )
    # --resume would be refused (no checkpoint): do not suggest it.
    return (
        f"training diverged at step {step}: {what}, lr {lr:.3g}. {done}; no checkpoint was saved. "
        f"{fix}, then start over (add overwrite=true to reuse output_dir)"
    )
