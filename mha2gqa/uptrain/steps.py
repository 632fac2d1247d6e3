"""The step loop: accumulate, clip when gradients sync, check the loss, step, log, eval, save.

Kept lean on purpose: on CPU the loop must cost within 5% of a hand-written torch loop
(bench/uptrain.py), so per-step work outside forward/backward/step is a few scalar ops.
"""

from __future__ import annotations

import functools
import math
import shutil
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
    """The loss or gradient norm became NaN/inf, the loss jumped far above its running level, or an
    eval fell to guessing: the step was not applied and nothing more was saved."""


# A step loss this many times its running level (and at least SPIKE_NATS above it) is divergence:
# ordinary loss noise stays well inside it, a destroyed model (loss near or above log vocab) does not.
SPIKE_RATIO, SPIKE_NATS, SPIKE_AFTER = 3.0, 1.0, 3


class Guard:
    """Divergence that a finite loss hides. A destructive update (optim.lr=1e6, say) gives finite
    losses for a step or two before the NaN; a checkpoint saved in between would be "the last good"
    one and poison every --resume. So a checkpoint or final model is saved only after an eval of the
    weights it holds passes `eval_problem`, and each step's loss is compared with its running level."""

    def __init__(self, vocab_size: int, best_eval: float | None = None):
        self.uniform = math.log(vocab_size)  # the loss of guessing uniformly over the vocabulary
        self.vocab_size = vocab_size
        self.best_eval = best_eval
        self.level: float | None = None  # running (EMA) level of the step loss
        self.steps = 0

    def step_problem(self, loss: float) -> str | None:
        if self.steps >= SPIKE_AFTER and loss > SPIKE_RATIO * self.level and loss - self.level > SPIKE_NATS:
            return f"loss {loss:.4g} jumped above {SPIKE_RATIO:g}x its running level {self.level:.4g}"
        self.level = loss if self.level is None else 0.9 * self.level + 0.1 * loss
        self.steps += 1
        return None

    def eval_problem(self, eval_loss: float) -> str | None:
        if not math.isfinite(eval_loss):
            return f"eval loss {eval_loss}"
        # A run that had been better than guessing and is now no better has destroyed the model (a model
        # trained from scratch may start at guessing: that alone is not divergence).
        if self.best_eval is not None and self.best_eval < self.uniform <= eval_loss:
            return (f"eval loss {eval_loss:.4g} is no better than guessing (log vocab_size {self.vocab_size} = "
                    f"{self.uniform:.4g}; this run had reached {self.best_eval:.4g})")
        self.best_eval = eval_loss if self.best_eval is None else min(self.best_eval, eval_loss)
        return None


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


def optimizer_step(run: Run, model, loss_fn, batches, step: int, guard: Guard | None = None
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
        raise TrainingDiverged(_diverged(run, step + 1, f"loss {loss_value}, grad norm {grad_norm}", lr))
    spike = guard.step_problem(loss_value) if guard is not None else None
    if spike:
        raise TrainingDiverged(_diverged(run, step + 1, f"{spike}, grad norm {grad_norm}", lr))
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
    guard = Guard(acc.unwrap_model(run.model).config.vocab_size, _checkpoint_eval(run, start))
    evals = None
    if start == 0 and r.eval_at_start:
        evals = _checked_eval(run, eval_blocks, guard, 0, lr_at(0, run.total, r.optim))
        run.metrics.write(0, 0, lr_at(0, run.total, r.optim), None, evals)
    stop_at = min(run.total, start + r.exit_after_steps) if r.exit_after_steps else run.total
    batches = run.data.train.batches(start * r.grad_accum)
    for step in range(start, stop_at):
        loss, grad_norm, lr = optimizer_step(run, model, loss_fn, batches, step, guard)
        done = step + 1
        run.metrics.step(loss, tps)
        is_eval = (r.eval_every and done % r.eval_every == 0) or done == run.total
        evals = _checked_eval(run, eval_blocks, guard, done, lr) if is_eval else None
        if is_eval or done % r.log_every == 0 or done == stop_at:
            run.metrics.write(done, done * tps, lr, grad_norm, evals)
        if (r.save_every and done % r.save_every == 0) or done == stop_at < run.total:
            # Only weights that pass an eval are saved: a checkpoint must be good to resume from.
            checked = evals or _checked_eval(run, eval_blocks, guard, done, lr)
            save_checkpoint(run, done, tps, checked["eval_loss"])
    if stop_at < run.total:
        return None
    # A resume from a checkpoint taken at the very last step runs no step: evaluate for the record
    # (and check, like every eval, before the final model is written).
    return evals if evals is not None else _checked_eval(run, eval_blocks, guard, run.total, lr_at(run.total, run.total, r.optim))


def _evaluate(run: Run, blocks: torch.Tensor) -> dict:
    loss, ppl = evaluate(run.model, blocks, run.recipe.micro_batch_size, run.accelerator)
    return {"eval_loss": loss, "eval_ppl": ppl}


def _checked_eval(run: Run, blocks: torch.Tensor, guard: Guard, step: int, lr: float) -> dict:
    """An eval that ends the run (TrainingDiverged, same on every rank: the loss is reduced) when the
    weights it measured are broken."""
    evals = _evaluate(run, blocks)
    problem = guard.eval_problem(evals["eval_loss"])
    if problem:
        raise TrainingDiverged(_diverged(run, step, problem, lr, applied=True))
    return evals


def _checkpoint_eval(run: Run, step: int) -> float | None:
    """The eval loss the checkpoint a run resumes from was saved with (its bar for divergence)."""
    if step == 0:
        return None
    progress = checkpoints.read_progress(checkpoints.checkpoint_dir(run.out, step)) or {}
    value = progress.get("eval_loss")
    return value if isinstance(value, float) else None


def save_checkpoint(run: Run, step: int, tps: int, eval_loss: float | None = None) -> Path:
    """accelerate save_state (model, optimizer, RNG of every rank), then progress.json, which marks
    the checkpoint complete; older checkpoints beyond keep_last go. A disk that is full or read-only
    ends the run with one line (the previous checkpoints stay)."""
    acc, ckpt = run.accelerator, checkpoints.checkpoint_dir(run.out, step)
    if acc.is_main_process:
        (ckpt / checkpoints.PROGRESS).unlink(missing_ok=True)  # re-saving a step: incomplete until done
        (ckpt / checkpoints.DAMAGED).unlink(missing_ok=True)  # set aside by a --resume; replaced now
    acc.wait_for_everyone()
    try:
        acc.save_state(str(ckpt))
        acc.wait_for_everyone()
        if acc.is_main_process:
            checkpoints.write_progress(ckpt, {
                "step": step, "tokens": step * tps, "total_steps": run.total, "eval_loss": eval_loss,
                "world_size": acc.num_processes, "recipe": run.recipe.to_dict(),
            })
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP while saving: no half checkpoint either
        if acc.is_main_process:
            shutil.rmtree(ckpt, ignore_errors=True)
        raise
    except Exception as err:  # noqa: BLE001 - torch.save and safetensors do not raise OSError for a full disk
        fault = checkpoints.write_failure(err, ckpt)
        if fault is None:
            raise
        if acc.is_main_process:
            shutil.rmtree(ckpt, ignore_errors=True)  # half a checkpoint is no checkpoint
        raise fault from err
    if acc.is_main_process:
        checkpoints.prune(run.out, run.recipe.keep_last)
    acc.wait_for_everyone()
    return ckpt


def _diverged(run: Run, step: int, what: str, lr: float, applied: bool = False) -> str:
    found = checkpoints.complete_checkpoints(run.out)
    done = "The weights were not saved" if applied else "The step was not applied"
    fix = "Lower optim.lr or raise optim.warmup_steps (or use bf16 instead of fp16)"
    if found:
        return (f"training diverged at step {step}: {what}, lr {lr:.3g}. {done}; the last good checkpoint is "
                f"{found[-1]}. {fix}, then continue with --resume or start over")
    # --resume would be refused (no checkpoint): do not suggest it.
    return (f"training diverged at step {step}: {what}, lr {lr:.3g}. {done}; no checkpoint was saved. "
            f"{fix}, then start over (add overwrite=true to reuse output_dir)")
