"""KL(parent || model) of next-token distributions: the one formula that refine's global stage, uptraining's
distillation loss and eval's agreement share. A leaf module (torch only), so convert/, eval/ and uptrain/ all
import it without importing each other."""

from __future__ import annotations

from typing import Literal

import torch


def kl_divergence(
    parent_logits: torch.Tensor,
    logits: torch.Tensor,
    temperature: float = 1.0,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> torch.Tensor:
    """KL(parent || model) over the last dim (the vocabulary) of two (..., V) logits, in float32 whatever their
    dtype (a log-softmax over a large vocabulary loses too much in bfloat16), both softened by `temperature`.
    reduction: "mean" over positions, "sum" of every term, "none" one value per position (...)."""
    log_p, log_q = _log_probs(parent_logits, temperature), _log_probs(logits, temperature)
    terms = log_p.exp() * (log_p - log_q)  # (..., V): torch's kl_div(log_q, log_p, log_target=True), unreduced
    if reduction == "sum":
        return terms.sum()
    per_position = terms.sum(-1)
    return per_position.mean() if reduction == "mean" else per_position


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return (logits if temperature == 1 else logits / temperature).log_softmax(-1)
