"""The step loop and what it needs: the learning rate at each step, the losses, the divergence
guard, and what a run reports (metrics.jsonl, tensorboard, the tqdm bar, the per-rank data trace).

Kept lean on purpose: on CPU the loop must cost within 5% of a hand-written torch loop
(bench/uptrain.py), so per-step work outside forward/backward/step is a few scalar ops.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa import jsontext
from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.progress import progress_bar
from mha2gqa.uptrain import checkpoints
from mha2gqa.uptrain.data import TrainData, block_hash, rank_slice
from mha2gqa.uptrain.distill import DistillLoss
from mha2gqa.uptrain.plan import tokens_per_step
from mha2gqa.uptrain.recipe import OptimConfig, Recipe

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


# ---- losses on packed blocks (every position is a real token: no mask needed) ----


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (B, S) token ids; the model shifts the labels itself."""
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


# ---- the step loop: accumulate, clip when gradients sync, check the loss, step, log, eval, save ----


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
    clock: object = NO_CLOCK  # the run's estimates Clock: the training's progress corrects the remaining time


def loss_function(run: Run, model):
    """batch (B, S) -> scalar loss: LM loss, or its mix with KL to the teacher (distill.py: in chunks of
    positions, except where the output layer's weights are sharded over processes)."""
    if run.teacher is None:
        return functools.partial(lm_loss, model)
    distill, acc = run.recipe.distill, run.accelerator
    loss = DistillLoss(
        model, acc.unwrap_model(run.model), run.teacher, distill.kl_weight, distill.temperature, acc.autocast
    )
    if acc.distributed_type.name in SHARDED:
        loss.chunked = False
    return loss


# accelerate's distributed types whose parameters are shards: the output layer is whole only inside the forward.
SHARDED = {"FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"}


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
    vocab = acc.unwrap_model(run.model).config.vocab_size
    guard = Guard(vocab, checkpoints.saved_eval_loss(run.out, start), weight_scale(run))
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
        run.clock.partial((done - start) / max(1, stop_at - start))
        is_eval = (r.eval_every and done % r.eval_every == 0) or done == run.total
        evals = _checked_eval(run, eval_blocks, guard, done, lr) if is_eval else None
        if is_eval or done % r.log_every == 0 or done == stop_at:
            run.metrics.write(done, done * tps, lr, grad_norm, evals)
        if (r.save_every and done % r.save_every == 0) or done == stop_at < run.total:
            # Only weights that pass an eval are saved: a checkpoint must be good to resume from.
            checked = evals or _checked_eval(run, eval_blocks, guard, done, lr)
            _save_checkpoint(run, done, tps, checked["eval_loss"])
    if stop_at < run.total:
        return None
    # A resume from a checkpoint taken at the very last step runs no step: evaluate for the record
    # (and check, like every eval, before the final model is written).
    return (
        evals
        if evals is not None
        else _checked_eval(run, eval_blocks, guard, run.total, lr_at(run.total, run.total, r.optim))
    )


def _evaluate(run: Run, blocks: torch.Tensor) -> dict:
    loss, ppl = evaluate(run.model, blocks, run.recipe.micro_batch_size, run.accelerator)
    return {"eval_loss": loss, "eval_ppl": ppl}


def _checked_eval(run: Run, blocks: torch.Tensor, guard: Guard, step: int, lr: float) -> dict:
    """An eval that ends the run (TrainingDiverged, same on every rank: the loss is reduced) when the
    weights it measured are broken."""
    evals = _evaluate(run, blocks)
    problem = guard.eval_problem(evals["eval_loss"], weight_scale(run))
    if problem:
        raise TrainingDiverged(_diverged(run, step, problem, lr, applied=True))
    return evals


def weight_scale(run: Run) -> float:
    """The largest |value| of any weight, over every rank's parameters (the same number on each)."""
    acc = run.accelerator
    with torch.no_grad():  # torch's max, not Python's: a NaN anywhere must come out as NaN
        shards = [_own_shard(p.detach()) for p in run.model.parameters()]
        peaks = [shard.abs().max().float() for shard in shards if shard.numel()]
        local = torch.stack(peaks).max().reshape(1) if peaks else torch.zeros(1)
    return float(acc.gather(local.to(acc.device)).max())


def _own_shard(parameter: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds, as a plain tensor. FSDP2 keeps each parameter as a DTensor:
    a reduction over it is a DTensor too, and accelerate's gather of one fails (no sharding strategy for
    all_gather); the gather below already takes the max over the ranks' shards."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


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


def _diverged(run: Run, step: int, what: str, lr: float, applied: bool = False) -> str:
    found = checkpoints.complete_checkpoints(run.out)
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


# ---- what a run reports: only the main process writes metrics; every rank writes its own trace ----

METRICS = "metrics.jsonl"


class Metrics:
    """One JSON object per line: step, tokens, loss (mean since the previous line; null on the
    step-0 line), lr, grad_norm, tokens_per_s, elapsed_s, cpu_s (this process's CPU seconds since the
    previous line: on a shared CPU, tokens_per_s falls with contention while cpu_s shows the work),
    and eval_loss/eval_ppl on eval steps."""

    def __init__(self, out: Path, accelerator, start_step: int, total: int, tensorboard: bool):
        self.main = accelerator.is_main_process
        self.accelerator, self.tensorboard = accelerator, tensorboard
        path = out / METRICS
        if self.main:
            # A resumed run keeps the lines up to its checkpoint; a fresh run (start_step -1) none.
            checkpoints.truncate_jsonl(path, lambda rec: rec["step"] <= start_step)
            self.file = path.open("a")
        self.bar = progress_bar(
            total,
            "uptrain",
            accelerator.is_local_main_process,
            initial=max(start_step, 0),
            unit="step",
            dynamic_ncols=True,
        )
        self._losses: list[float] = []
        self._since, self._tokens_since, self._cpu_since = time.perf_counter(), 0, time.process_time()
        self._started = self._since

    def step(self, loss: float, tokens: int) -> None:
        self._losses.append(loss)
        self._tokens_since += tokens
        self.bar.update(1)

    def write(self, step: int, tokens: int, lr: float, grad_norm: float | None, evals: dict | None = None) -> dict:
        now, cpu = time.perf_counter(), time.process_time()
        record = {
            "step": step,
            "tokens": tokens,
            "loss": sum(self._losses) / len(self._losses) if self._losses else None,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self._tokens_since / (now - self._since) if self._tokens_since else None,
            "elapsed_s": round(now - self._started, 3),
            "cpu_s": round(cpu - self._cpu_since, 3),
            **(evals or {}),
        }
        self._losses, self._since, self._tokens_since, self._cpu_since = [], now, 0, cpu
        if self.main:
            self.file.write(jsontext.dumps(record) + "\n")
            self.file.flush()
            if self.tensorboard:
                numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
                self.accelerator.log(numbers, step=step)
        shown = {k: record[k] for k in ("loss", "eval_ppl") if record.get(k) is not None}
        if record["tokens_per_s"]:
            shown["tok/s"] = record["tokens_per_s"]
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
        return record

    def close(self) -> None:
        self.bar.close()
        if self.main:
            self.file.close()


def finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


class Trace:
    """Audit trail of the data order: trace/rank<N>.jsonl gets a content hash of every block this rank
    trained on, and at the end a checksum of its parameters (equal on every rank under DDP)."""

    def __init__(self, out: Path, rank: int, start_micro: int):
        path = out / "trace" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoints.truncate_jsonl(path, lambda rec: "micro" in rec and rec["micro"] < start_micro)
        self.file = path.open("a")

    def batch(self, step: int, micro: int, batch: torch.Tensor) -> None:
        hashes = [block_hash(row) for row in batch.cpu()]
        self.file.write(jsontext.dumps({"step": step, "micro": micro, "blocks": hashes}) + "\n")

    def finish(self, model: torch.nn.Module) -> None:
        sums = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}
        self.file.write(jsontext.dumps({"final_param_sums": sums}) + "\n")
        self.file.close()
