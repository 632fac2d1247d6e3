"""Sliding-window perplexity, token-weighted and exact.

Windows of `context` tokens start every `stride` tokens. Token p (p >= 1) is scored once, by the
first window that predicts it, so every scored token after the first window sees at least
`context - stride` tokens of context. With stride == context the windows do not overlap and the
first token of each window has no prediction inside it: it is left unscored (see `tokens_scored`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.progress import progress_bar


@dataclass(frozen=True)
class Window:
    start: int  # first input token
    end: int  # one past the last input token
    scored: int  # the last `scored` tokens of the window are targets scored here


def windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows covering a stream of n_tokens; each target token is scored by exactly one."""
    validate_window(context, stride)
    out, next_target, start = [], 1, 0  # token 0 has no prediction
    while True:
        end = min(start + context, n_tokens)
        first = max(next_target, start + 1)
        out.append(Window(start, end, end - first))
        if end == n_tokens:
            return out
        next_target, start = end, start + stride


def validate_window(context: int, stride: int) -> None:
    if context < 2:
        raise InputError(f"--context {context} must be at least 2 (a token and the one it predicts)")
    if not 1 <= stride <= context:
        raise InputError(
            f"--stride {stride} must be between 1 and --context {context}: use e.g. {max(1, context // 2)}"
        )


def scored_logits(
    model, ids: torch.Tensor, wins: list[Window], batch_size: int = 1, progress: bool | str = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For each batch of windows: (logits (n, V) float32, targets (n,)) of the tokens scored there. progress:
    a bar, labelled with the string given (its model, domain and stage) or 'windows'."""
    device = next(model.parameters()).device
    label = progress if isinstance(progress, str) else "windows"
    bar = progress_bar(len(wins), label, bool(progress), unit="win", leave=False)
    for batch in _same_length_batches(wins, batch_size):
        inputs = torch.stack([ids[w.start : w.end] for w in batch]).to(device)  # (B, T)
        keep = max(w.scored for w in batch) + 1  # the last position predicts nothing in-window
        with torch.no_grad():
            logits = model(inputs, logits_to_keep=keep).logits  # (B, keep, V)
        for row, w in zip(logits, batch):
            # Positions keep-1-scored .. keep-2 predict targets end-scored .. end-1.
            yield row[keep - 1 - w.scored : keep - 1].float(), ids[w.end - w.scored : w.end].to(device)
        bar.update(len(batch))
    bar.close()


def _same_length_batches(wins: list[Window], batch_size: int) -> Iterator[list[Window]]:
    """Consecutive windows of equal length, at most batch_size at a time (no padding needed)."""
    batch: list[Window] = []
    for w in wins:
        if batch and (len(batch) == batch_size or w.end - w.start != batch[0].end - batch[0].start):
            yield batch
            batch = []
        batch.append(w)
    if batch:
        yield batch


class NllTally:
    """Summed negative log-likelihood over scored tokens (float64: long texts must not drift)."""

    def __init__(self):
        self.nll, self.tokens = 0.0, 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.nll += F.cross_entropy(logits, targets, reduction="sum").double().item()
        self.tokens += targets.numel()

    def result(self) -> dict:
        mean = self.nll / self.tokens if self.tokens else float("nan")
        perplexity = float("inf") if mean > 709 else math.exp(mean)  # math.exp raises past 709.78; NaN stays NaN
        return {"perplexity": perplexity, "nll_per_token": mean, "tokens_scored": self.tokens}


def perplexity(
    model, ids: torch.Tensor, context: int, stride: int, batch_size: int = 1, progress: bool | str = False
) -> dict:
    """exp(mean NLL) over every scored token of `ids`, with the window settings recorded."""
    wins = windows(ids.numel(), context, stride)
    tally = NllTally()
    for logits, targets in scored_logits(model, ids, wins, batch_size, progress):
        tally.add(logits, targets)
    return {**tally.result(), "context": context, "stride": stride, "windows": len(wins)}
