"""Agreement with a reference model on the same tokens: mean KL(reference || model) per scored
token and top-1 next-token agreement. One pass also yields both models' perplexities.

A reference may also be given by its top tokens (TopTokens: what convert's check keeps of a parent in its
cache, a few MB instead of every position's whole vocabulary): the KL is then kl.py's, between the two
distributions coarsened to those tokens and one bucket for the rest, a lower bound of the full KL (the
data-processing inequality) and equal to it when the top tokens are the whole vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mha2gqa.runtime.errors import InputError
from mha2gqa.scoring.kl import kl_divergence
from mha2gqa.scoring.perplexity import NllTally, scored_logits, windows


class AgreementTally:
    def __init__(self):
        self.kl, self.same, self.tokens = 0.0, 0, 0

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor) -> None:
        """ref_logits, logits: (n, V) for the same n scored positions."""
        self._count(kl_divergence(ref_logits, logits, reduction="sum"), ref_logits.argmax(-1), logits.argmax(-1))

    def add_top(self, ref: TopTokens, logits: torch.Tensor) -> None:
        """Against a reference known by its top tokens at the same n positions; logits (n, V)."""
        coarse, ids = ref.coarse.to(logits.device), ref.ids.to(logits.device)
        self._count(kl_divergence(coarse, coarsened(logits, ids), reduction="sum"), ids[:, 0], logits.argmax(-1))

    def _count(self, kl_sum: torch.Tensor, ref_best: torch.Tensor, best: torch.Tensor) -> None:
        self.kl += kl_sum.double().item()
        self.same += int((ref_best == best).sum())
        self.tokens += best.shape[0]

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


# ---- a reference known by its top tokens ----

RARE = -1e30  # the log-probability of an empty bucket: finite, so that 0 * (log p - log q) stays 0 in the KL


@dataclass
class TopTokens:
    """A reference's next-token distributions at n scored positions, kept as its k most likely tokens."""

    ids: torch.Tensor  # (n, k) int64, most likely first
    coarse: torch.Tensor  # (n, k) or (n, k + 1) float32: their log-probabilities, then the rest's when k < V

    def rows(self, start: int, stop: int) -> TopTokens:
        return TopTokens(self.ids[start:stop], self.coarse[start:stop])


def top_tokens(logits: torch.Tensor, k: int) -> TopTokens:
    """The k (at most V) most likely tokens of each row of logits (n, V), with the distribution coarsened to them."""
    ids = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    return TopTokens(ids, coarsened(logits, ids))


def coarsened(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The distribution of logits (n, V) over the tokens ids (n, k) and one bucket for all others (left out when
    k == V): log-probabilities (n, k[+1]) float32, the bucket's a logsumexp (exact, however small its mass)."""
    log_probs = logits.float().log_softmax(-1)
    picked = log_probs.gather(1, ids)
    if ids.shape[-1] == logits.shape[-1]:
        return picked
    rest = log_probs.scatter(1, ids, float("-inf")).logsumexp(-1).clamp_min(RARE)
    return torch.cat([picked, rest[:, None]], dim=-1)


def reference_top(
    model, ids: torch.Tensor, context: int, stride: int, k: int, batch_size: int = 1, progress: bool | str = False
) -> tuple[dict, TopTokens]:
    """(the reference's perplexity, its top k tokens) at every scored position of `ids`' windows: what
    agreement_with_top compares a model with, without running the reference again."""
    wins = windows(ids.numel(), context, stride)
    nll, tops = NllTally(), []
    for logits, targets in scored_logits(model, ids, wins, batch_size, progress):
        nll.add(logits, targets)
        tops.append(top_tokens(logits, k))
    ref = TopTokens(torch.cat([t.ids for t in tops]).cpu(), torch.cat([t.coarse for t in tops]).cpu())
    return {**nll.result(), "context": context, "stride": stride, "windows": len(wins)}, ref


def agreement_with_top(
    model, ids: torch.Tensor, context: int, stride: int, ref: TopTokens, batch_size: int = 1, progress=False
) -> tuple[dict, dict]:
    """(agreement, model perplexity) over the windows reference_top scored `ref` on."""
    wins = windows(ids.numel(), context, stride)
    tally, nll, row = AgreementTally(), NllTally(), 0
    for logits, targets in scored_logits(model, ids, wins, batch_size, progress):
        n = targets.numel()
        tally.add_top(ref.rows(row, row + n), logits)
        nll.add(logits, targets)
        row += n
    return tally.result(), {**nll.result(), "context": context, "stride": stride, "windows": len(wins)}
