"""The step loop: accumulate, clip when gradients sync, check the loss, step, log, eval, save.

Kept lean on purpose: on CPU the loop must cost within 5% of a hand-written torch loop
(bench/uptrain.py), so per-step work outside forward/backward/step is a few scalar ops.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.uptrain import checkpoints
from mha2gqa.uptrain.data import rank_slice
from mha2gqa.uptrain.data_setup import TrainData
from mha2gqa.uptrain.losses import distill_loss, evaluate, lm_loss
from mha2gqa.uptrain.metrics import Metrics, Trace, finite
from mha2gqa.uptrain.recipe import Recipe
from mha2gqa.uptrain.schedule import lr_at, tokens_per_step


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the step was not applied and nothing was saved."""


@dataclass
class Run:
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


def loss_function(run: Run, model):
    """batch (B, S) -> scalar loss: LM loss, or its mix with KL to the teacher."""
    if run.teacher is None:
        return functools.partial(lm_loss, model)
    return functools.partial(distill_loss, model, run.teacher, kl_weight=run.recipe.distill.kl_weight,
                             temperature=run.recipe.distill.temperature, autocast=run.accelerator.autocast)


def optimizer_step(run: Run, model, loss_fn, batches, step: int) -> tuple[float, float | None, float]:
    """One optimizer step (0-based `step`): set the LR, accumulate grad_accum micro-batches, clip when
    the gradients sync, stop on a non-finite loss or norm, apply. Returns (loss, grad norm, lr)."""
    r, acc, ga = run.recipe, run.accelerator, run.recipe.grad_accum
    lr = lr_at(step, run.total, r.optim)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=acc.device)
    for micro in range(ga):
        batch = next(batches).to(acc.device, non_blocking=True)  # (micro_batch, seq_len)
        if run.trace is not None:
            run.trace.batch(step, step * ga + micro, batch)
        with acc.accumulate(model):  # syncs gradients on the last micro-batch only
            loss = loss_fn(batch)
            acc.backward(loss)
        loss_sum += loss.detach()
    # The norm is computed even without clipping (max_norm inf): it is the NaN guard on gradients.
    norm = acc.clip_grad_norm_(run.model.parameters(), r.optim.grad_clip or math.inf)
    grad_norm = None if norm is None else float(norm)
    loss_value = float(acc.reduce(loss_sum / ga, "mean"))
    # fp16's loss scaler skips overflowing steps by design; elsewhere a non-finite norm is divergence.
    if not finite(loss_value) or (r.mixed_precision != "fp16" and not finite(grad_norm)):
        raise TrainingDiverged(_diverged(run, step + 1, loss_value, grad_norm, lr))
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_value, grad_norm, lr


def run_steps(run: Run, start: int) -> dict | None:
    """Train from optimizer step `start`; returns the final eval metrics, or None when stopped early
    by exit_after_steps (after saving a resumable checkpoint)."""
    r, acc = run.recipe, run.accelerator
    tps = tokens_per_step(r, acc.num_processes)
    model = torch.compile(run.model) if r.compile else run.model
    loss_fn = loss_function(run, model)
    eval_blocks = rank_slice(run.data.eval, acc.process_index, acc.num_processes)
    evals = None
    if start == 0 and r.eval_at_start:
        evals = _evaluate(run, eval_blocks)
        run.metrics.write(0, 0, lr_at(0, run.total, r.optim), None, evals)
    stop_at = min(run.total, start + r.exit_after_steps) if r.exit_after_steps else run.total
    batches = run.data.train.batches(start * r.grad_accum)
    for step in range(start, stop_at):
        loss, grad_norm, lr = optimizer_step(run, model, loss_fn, batches, step)
        done = step + 1
        run.metrics.step(loss, tps)
        is_eval = (r.eval_every and done % r.eval_every == 0) or done == run.total
        if is_eval or done % r.log_every == 0 or done == stop_at:
            evals = _evaluate(run, eval_blocks) if is_eval else None
            run.metrics.write(done, done * tps, lr, grad_norm, evals)
        if (r.save_every and done % r.save_every == 0) or done == stop_at < run.total:
            save_checkpoint(run, done, tps)
    if stop_at < run.total:
        return None
    # A resume from a checkpoint taken at the very last step runs no step: evaluate for the record.
    return evals if evals is not None else _evaluate(run, eval_blocks)


def _evaluate(run: Run, blocks: torch.Tensor) -> dict:
    loss, ppl = evaluate(run.model, blocks, run.recipe.micro_batch_size, run.accelerator)
    return {"eval_loss": loss, "eval_ppl": ppl}


def save_checkpoint(run: Run, step: int, tps: int) -> Path:
    """accelerate save_state (model, optimizer, RNG of every rank), then progress.json, which marks
    the checkpoint complete; older checkpoints beyond keep_last go."""
    acc, ckpt = run.accelerator, checkpoints.checkpoint_dir(run.out, step)
    if acc.is_main_process:
        (ckpt / checkpoints.PROGRESS).unlink(missing_ok=True)  # re-saving a step: incomplete until done
    acc.wait_for_everyone()
    acc.save_state(str(ckpt))
    acc.wait_for_everyone()
    if acc.is_main_process:
        checkpoints.write_progress(ckpt, {
            "step": step, "tokens": step * tps, "total_steps": run.total,
            "world_size": acc.num_processes, "recipe": run.recipe.to_dict(),
        })
        checkpoints.prune(run.out, run.recipe.keep_last)
    acc.wait_for_everyone()
    return ckpt


def _diverged(run: Run, step: int, loss: float, grad_norm: float | None, lr: float) -> str:
    found = checkpoints.complete_checkpoints(run.out)
    last = f"the last good checkpoint is {found[-1]}" if found else "no checkpoint was saved yet"
    return (
        f"training diverged at step {step}: loss {loss}, grad norm {grad_norm}, lr {lr:.3g}. The step was not "
        f"applied; {last}. Lower optim.lr or raise optim.warmup_steps (or use bf16 instead of fp16), then "
        "continue with --resume or start over"
    )
