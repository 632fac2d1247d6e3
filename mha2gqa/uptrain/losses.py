"""Training and eval losses on packed blocks (every position is a real token: no mask needed)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (B, S) token ids; the model shifts the labels itself."""
    return model(input_ids=batch, labels=batch, use_cache=False).loss


def kl_teacher_student(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of next-token distributions, mean over positions, scaled by T^2 so that
    its gradient does not shrink as T grows (Hinton et al. 2015)."""
    vocab = student_logits.shape[-1]
    # (B, S, V) -> (B*S, V), float32: log-softmax over a large vocab loses too much in bf16
    log_s = F.log_softmax(student_logits.reshape(-1, vocab).float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.reshape(-1, vocab).float() / temperature, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean") * temperature**2


def distill_loss(model, teacher, batch: torch.Tensor, kl_weight: float, temperature: float, autocast) -> torch.Tensor:
    """(1 - w) * LM loss + w * T^2 * KL(teacher || student)."""
    out = model(input_ids=batch, labels=batch, use_cache=False)
    with torch.no_grad(), autocast():
        teacher_logits = teacher(input_ids=batch, use_cache=False).logits
    return (1 - kl_weight) * out.loss + kl_weight * kl_teacher_student(out.logits, teacher_logits, temperature)


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, micro_batch: int, accelerator) -> tuple[float, float]:
    """Mean next-token loss and perplexity over this rank's eval blocks, combined over all ranks.
    Every rank runs the same number of forwards (FSDP and ZeRO-3 forwards are collective)."""
    model.eval()
    loss_sum, count = torch.zeros((), dtype=torch.float64, device=accelerator.device), 0
    for lo in range(0, len(blocks), micro_batch):
        batch = blocks[lo: lo + micro_batch].long().to(accelerator.device)
        # Equal-length blocks: batch means weighted by batch size average to the token mean.
        loss_sum += lm_loss(model, batch).double() * len(batch)
        count += len(batch)
    model.train()
    total = accelerator.reduce(torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64,
                                                                   device=loss_sum.device)]), "sum")
    loss = (total[0] / total[1].clamp(min=1)).item()
    return loss, math.exp(min(loss, 700.0))
