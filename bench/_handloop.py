"""The hand-written reference training step the uptrain benchmarks compare against (one copy, shared).

forward with labels, backward, clip the gradient norm to 1.0, fused AdamW step, zero_grad: the minimal
loop a user would write, with the same optimizer settings as the recipes the benchmarks run.
"""

from __future__ import annotations

import torch


def hand_optimizer(model, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def hand_step(forward, model, optimizer, batch: torch.Tensor, autocast) -> torch.Tensor:
    """One optimizer step on `batch` (batch, seq_len) int64; `forward` is the model or its compiled form."""
    with autocast:
        loss = forward(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
