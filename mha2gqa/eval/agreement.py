"""Agreement with a reference model on the same tokens: mean KL(reference || model) per scored
token and top-1 next-token agreement. One pass also yields both models' perplexities."""

from __future__ import annotations

import torch

from mha2gqa.errors import InputError
from mha2gqa.eval.perplexity import NllTally, scored_logits, windows
from mha2gqa.kl import kl_divergence


class AgreementTally:
    def __init__(self):
        self.kl, self.same, self.tokens = 0.0, 0, 0

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor) -> None:
        """ref_logits, logits: (n, V) for the same n scored positions."""
        self.kl += kl_divergence(ref_logits, logits, reduction="sum").double().item()
        self.same += int((ref_logits.argmax(-1) == logits.argmax(-1)).sum())
        self.tokens += logits.shape[0]

    def result(self) -> dict:
        return {"kl_mean": self.kl / self.tokens, "top1_agreement": self.same / self.tokens, "tokens": self.tokens}


def agreement(
    model, reference, ids: torch.Tensor, context: int, stride: int, batch_size: int = 1, progress: bool | str = False
) -> tuple[dict, dict, dict]:
    """(agreement, model perplexity, reference perplexity) over the same windows of `ids`."""
    if model.config.vocab_size != reference.config.vocab_size:
        raise InputError(
            f"--reference has vocab_size={reference.config.vocab_size} but the model has "
            f"{model.config.vocab_size}: compare models that share a tokenizer"
        )
    wins = windows(ids.numel(), context, stride)
    tally, nll, ref_nll = AgreementTally(), NllTally(), NllTally()
    pairs = zip(scored_logits(model, ids, wins, batch_size, progress), scored_logits(reference, ids, wins, batch_size))
    for (logits, targets), (ref_logits, _) in pairs:
        ref_logits = ref_logits.to(logits.device)
        tally.add(ref_logits, logits)
        nll.add(logits, targets)
        ref_nll.add(ref_logits, targets)
    settings = {"context": context, "stride": stride, "windows": len(wins)}
    return tally.result(), {**nll.result(), **settings}, {**ref_nll.result(), **settings}
