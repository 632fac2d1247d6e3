"""The training loop, top to bottom: `run_steps` walks the optimizer steps (evals, logs and checkpoints on
their schedule) and `optimizer_step` is one step from batch to update: set the learning rate, accumulate the
micro-batches' loss and gradients, clip, ask the guard, apply. What the loop calls out to lives beside it:
guard.py (divergence), reporting.py (metrics.jsonl, the bar, the trace), checkpoints.py (save, resume),
distill.py (the KD loss); loop.py sets the run up around it and saves the result.

Kept lean on purpose: on CPU the loop must cost within 5% of a hand-written torch loop (measured by the
uptrain benchmark), so per-step work outside forward/backward/step is a few scalar ops.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.uptrain import checkpoints
from mha2gqa.uptrain.data import TrainData, rank_slice
from mha2gqa.uptrain.distill import DistillLoss
from mha2gqa.uptrain.guard import Guard, TrainingDiverged, diverged_message, finite, weight_scale
from mha2gqa.uptrain.plan import tokens_per_step
from mha2gqa.uptrain.recipe import OptimConfig, Recipe
from mha2gqa.uptrain.reporting import Metrics, Trace


@dataclass
class Run:
    """Everything the loop reads: the recipe, the prepared model and optimizer, the data, where it reports."""

    recipe: Recipe
    accelerator: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    teacher: torch.nn.Module | None
    data: TrainData
    out: Path
    total: int
    metrics: Metrics
    trace: Trace | None
    clock: object = NO_CLOCK  # the run's estimates Clock: the training's progress corrects the remaining time
    probes: object = None  # probe_evals.ProbeEvals: the retrieval probe and the domains at each eval, when asked


def run_steps(run: Run, start: int) -> dict | None:
    """Train from optimizer step `start`; returns the final eval metrics, or None when stopped early
    by exit_after_steps (after saving a resumable checkpoint)."""
    r, acc = run.recipe, run.accelerator
    tps = tokens_per_step(r, acc.num_processes)
    model = torch.compile(run.model) if r.compile else run.model
    loss_fn = loss_function(run, model)
    eval_blocks = rank_slice(run.data.eval, acc.process_index, acc.num_processes)
    vocab = acc.unwrap_model(run.model).config.vocab_size
    guard = Guard(vocab, checkpoints.saved_eval_loss(run.out, start), weight_scale(run.model, run.accelerator))
    evals = None
    if start == 0 and r.eval_at_start:
        evals = _guarded_eval(run, eval_blocks, guard, 0, lr_at(0, run.total, r.optim))
        run.metrics.write(0, 0, lr_at(0, run.total, r.optim), None, evals)
    stop_at = min(run.total, start + r.exit_after_steps) if r.exit_after_steps else run.total
    batches = run.data.train.batches(start * r.grad_accum)
    for step in range(start, stop_at):
        loss, grad_norm, lr = optimizer_step(run, model, loss_fn, batches, step, guard)
        done = step + 1
        run.metrics.step(loss, tps)
        run.clock.partial((done - start) / max(1, stop_at - start))
        is_eval = (r.eval_every and done % r.eval_every == 0) or done == run.total
        evals = _guarded_eval(run, eval_blocks, guard, done, lr) if is_eval else None
        if is_eval or done % r.log_every == 0 or done == stop_at:
            run.metrics.write(done, done * tps, lr, grad_norm, evals)
        if (r.save_every and done % r.save_every == 0) or done == stop_at < run.total:
            # Only weights that pass an eval are saved: a checkpoint must be good to resume from.
            checked = evals or _guarded_eval(run, eval_blocks, guard, done, lr)
            _save_checkpoint(run, done, tps, checked["eval_loss"])
    if stop_at < run.total:
        return None
    # A resume from a checkpoint taken at the very last step runs no step: evaluate for the record
    # (and check, like every eval, before the final model is written).
    return (
        evals
        if evals is not None
        else _guarded_eval(run, eval_blocks, guard, run.total, lr_at(run.total, run.total, r.optim))
    )


def optimizer_step(
    run: Run, model, loss_fn, batches, step: int, guard: Guard | None = None
) -> tuple[float, float | None, float]:
    """One optimizer step (0-based `step`): set the LR, accumulate grad_accum micro-batches, clip when
    the gradients sync, stop on a non-finite loss or norm (or a loss spike, with a guard), apply.
    Returns (loss, grad norm, lr)."""
    r, acc, ga = run.recipe, run.accelerator, run.recipe.grad_accum
    lr = lr_at(step, run.total, r.optim)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=acc.device)
    for micro in range(ga):
        batch = next(batches)  # (micro_batch, seq_len), or with data.train retrieval (ids, answer marks)
        batch, marks = batch if isinstance(batch, tuple) else (batch, None)
        batch = batch.to(acc.device, non_blocking=True)
        if run.trace is not None:
            run.trace.batch(step, step * ga + micro, batch)
        with acc.accumulate(model):  # syncs gradients on the last micro-batch only
            loss = loss_fn(batch) if marks is None else loss_fn(batch, marks.to(acc.device))
            acc.backward(loss)
        loss_sum += loss.detach()
    # The norm is computed even without clipping (max_norm inf): it is the NaN guard on gradients.
    norm = acc.clip_grad_norm_(run.model.parameters(), r.optim.grad_clip or math.inf)
    grad_norm = None if norm is None else float(norm)
    loss_value = float(acc.reduce(loss_sum / ga, "mean"))
    # fp16's loss scaler skips overflowing steps by design; elsewhere a non-finite norm is divergence.
    if not finite(loss_value) or (r.mixed_precision != "fp16" and not finite(grad_norm)):
        raise TrainingDiverged(diverged_message(run.out, step + 1, f"loss {loss_value}, grad norm {grad_norm}", lr))
    spike = guard.step_problem(loss_value) if guard is not None else None
    if spike:
        raise TrainingDiverged(diverged_message(run.out, step + 1, f"{spike}, grad norm {grad_norm}", lr))
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_value, grad_norm, lr


def loss_function(run: Run, model):
    """batch (B, S) -> scalar loss: LM loss, or its mix with KL to the teacher (distill.py: in chunks of
    positions, except where the output layer's weights are sharded over processes)."""
    if run.teacher is None:
        return functools.partial(lm_loss, model)
    distill, acc = run.recipe.distill, run.accelerator
    loss = DistillLoss(
        model,
        acc.unwrap_model(run.model),
        run.teacher,
        distill.kl_weight,
        distill.temperature,
        acc.autocast,
        distill.answer_weight,
    )
    if acc.distributed_type.name in SHARDED:
        loss.chunked = False
    return loss


# accelerate's distributed types whose parameters are shards: the output layer is whole only inside the forward.
SHARDED = {"FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"}


# ---- losses on packed blocks (every position is a real token: no mask needed) ----


def lm_loss(model, batch: torch.Tensor, marks=None) -> torch.Tensor:
    """Mean next-token cross-entropy of (B, S) token ids; the model shifts the labels itself. Answer marks
    change nothing here (distill.answer_weight needs the teacher: recipe_load refuses it without one)."""
    return model(input_ids=batch, labels=batch, use_cache=False).loss


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, micro_batch: int, accelerator) -> tuple[float, float]:
    """Mean next-token loss and perplexity over this rank's eval blocks, combined over all ranks.
    Every rank runs the same number of forwards (FSDP and ZeRO-3 forwards are collective)."""
    model.eval()
    loss_sum, count = torch.zeros((), dtype=torch.float64, device=accelerator.device), 0
    for lo in range(0, len(blocks), micro_batch):
        batch = blocks[lo : lo + micro_batch].long().to(accelerator.device)
        # Equal-length blocks: batch means weighted by batch size average to the token mean.
        loss_sum += lm_loss(model, batch).double() * len(batch)
        count += len(batch)
    model.train()
    total = accelerator.reduce(
        torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64, device=loss_sum.device)]), "sum"
    )
    loss = (total[0] / total[1].clamp(min=1)).item()
    return loss, math.exp(min(loss, 700.0))


# ---- how long, and the learning rate at each step (a pure function of the step, so that a
# resumed run needs no scheduler state to continue exactly) ----


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


def _evaluate(run: Run, blocks: torch.Tensor) -> dict:
    loss, ppl = evaluate(run.model, blocks, run.recipe.micro_batch_size, run.accelerator)
    found = {"eval_loss": loss, "eval_ppl": ppl}
    if run.probes:
        found |= run.probes.measure(run.model, run.accelerator.device)
    return found


def _guarded_eval(run: Run, blocks: torch.Tensor, guard: Guard, step: int, lr: float) -> dict:
    """An eval that ends the run (TrainingDiverged, same on every rank: the loss is reduced) when the
    weights it measured are broken."""
    evals = _evaluate(run, blocks)
    problem = guard.eval_problem(evals["eval_loss"], weight_scale(run.model, run.accelerator))
    if problem:
        raise TrainingDiverged(diverged_message(run.out, step, problem, lr, applied=True))
    return evals


def _save_checkpoint(run: Run, step: int, tps: int, eval_loss: float) -> Path:
    """A resumable checkpoint; its progress.json holds what --resume checks and continues from."""
    acc = run.accelerator
    progress = {
        "step": step,
        "tokens": step * tps,
        "total_steps": run.total,
        "eval_loss": eval_loss,
        "world_size": acc.num_processes,
        "recipe": run.recipe.to_dict(),
    }
    return checkpoints.save_checkpoint(acc, run.out, progress, run.recipe.keep_last)
