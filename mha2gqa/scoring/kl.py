"""KL(parent || model) of next-token distributions: the one formula that refine's global stage, uptraining's
distillation loss and eval's agreement share. A leaf module (torch only), so convert/, eval/ and uptrain/ all
import it without importing each other.

The gradient is written by hand (_TargetKL) when only the model's logits need one, as in every fit here: the
gradient of KL(p || softmax(z / T)) with respect to z is (softmax(z / T) - p) / T, one vocabulary-wide tensor
computed in the forward. Autograd's chain through the log-softmax, the product and the sum keeps three such
tensors: at one SmolLM2 block (512 positions x 49,152 tokens, 2 CPU threads) forward and backward take 0.145 s
against its 0.200 s (bench/kl_speed.py), about 2% of a global refine step."""

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
    if parent_logits.requires_grad or not torch.is_grad_enabled() or not logits.requires_grad:
        per_position = kl_through_autograd(parent_logits, logits, temperature)
    else:
        per_position = _TargetKL.apply(parent_logits, logits, temperature)
    if reduction == "sum":
        return per_position.sum()
    return per_position.mean() if reduction == "mean" else per_position


def kl_through_autograd(parent_logits: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The per-position KL as plain tensor operations, whose gradient autograd takes: kl_divergence's path when
    the parent's logits need a gradient or none is taken, and the reference its hand-written gradient is
    tested (tests/test_kl.py) and timed (bench/kl_speed.py) against."""
    log_p, log_q = _log_probs(parent_logits, temperature), _log_probs(logits, temperature)
    return (log_p.exp() * (log_p - log_q)).sum(-1)  # torch's kl_div(log_q, log_p, log_target=True), per position


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return (logits if temperature == 1 else logits / temperature).log_softmax(-1)


class _TargetKL(torch.autograd.Function):
    """Per-position KL(parent || model) whose backward gives the model's logits (softmax(z / T) - p) / T times
    the incoming gradient, and the parent's logits none (a fixed target). Keeps that one float32 tensor."""

    @staticmethod
    def forward(ctx, parent_logits, logits, temperature):
        with torch.autocast(logits.device.type, enabled=False):  # float32 throughout, inside a mixed-precision loop
            log_p, log_q = _log_probs(parent_logits, temperature), _log_probs(logits, temperature)
            p = log_p.exp()
            per_position = torch.linalg.vecdot(p, log_p.sub_(log_q))
            ctx.save_for_backward(log_q.exp_().sub_(p).div_(temperature))  # in place: no third V-wide tensor
        ctx.logits_dtype = logits.dtype
        return per_position

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors
        return None, (slope * grad.unsqueeze(-1)).to(ctx.logits_dtype), None
