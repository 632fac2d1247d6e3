"""What a run reports as it trains: metrics.jsonl (and tensorboard), the progress bar, and the per-rank data
trace. Only the main process writes metrics; every rank writes its own trace."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mha2gqa.files import jsontext
from mha2gqa.runtime.progress import progress_bar
from mha2gqa.uptrain import checkpoints
from mha2gqa.uptrain.data import block_hash

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
