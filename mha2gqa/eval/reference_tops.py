"""A reference known by its top tokens: eval's agreement with a reference that is not run beside the model.

`--reference PARENT` loads the parent and runs it on the same windows (scoring/agreement.py agreement). A
TopReference instead gives, per text, the parent's summed loss and its k most likely tokens at each scored
position (scoring/agreement.py TopTokens): eval compares the model with those (agreement_with_top; the KL is
kl.py's over the top tokens and one bucket for the rest, a lower bound of the full KL and equal to it when k is
the whole vocabulary). Its numbers are `known` when the texts are read (convert's check reads its cache of
them, convert/check_cache.py) or scored by eval once, then handed to `scored` (the check keeps them). The
parent is loaded only when its numbers must be scored (alone, before the model: one model in memory at a time)
or the retrieval probe asks it too; a parent already in memory (`model`) is scored as it is. Its tokenizer reads
the texts unless --tokenizer names another: its numbers are positions of the ids that tokenizer gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mha2gqa.scoring.agreement import TopTokens


@dataclass
class DomainTops:
    """The reference on one text: its summed NLL over `tokens` scored positions and its top tokens there."""

    nll: float
    tokens: int
    top: TopTokens

    @property
    def perplexity(self) -> float:
        mean = self.nll / self.tokens
        return float("inf") if mean > 709 else math.exp(mean)  # math.exp raises past 709.78; NaN stays NaN


class TopReference:
    """A reference given by its top tokens on each text (module docstring); a subclass that keeps them elsewhere
    overrides `known` and `scored`."""

    def __init__(self, path: Path, top_k: int, model: Any = None, name: str = "--reference"):
        self.path = Path(path)  # its folder: its label, its tokenizer, its weights when its numbers are scored
        self.top_k = top_k  # tokens kept per position
        self.model = model  # already loaded: scored as it is (moved to eval's device), never loaded again
        self.name = name  # how a message names it (convert's check: SRC)

    def __str__(self) -> str:
        return str(self.path)

    def loaded(self, dtype, device):
        """Its model on `device`: the one in memory as it is, else loaded (eval/model.py)."""
        from mha2gqa.eval.model import load_model

        if self.model is not None:
            return self.model.to(device).eval()
        return load_model(self.path, dtype, device, False, self.name)

    def known(self, ids: dict[str, torch.Tensor], context: int, stride: int, vocab: int) -> dict | None:
        """{text: DomainTops} on these ids when known already; None: eval scores them. Called once the texts are
        read, before any weights are loaded."""
        return None

    def scored(self, numbers: dict[str, DomainTops]) -> None:
        """Told the numbers eval scored (before the model is compared with them)."""


def score_tops(reference: TopReference, texts: dict, context: int, stride: int, dtype, device, bar: str | bool):
    """The reference's numbers on every text (eval.data.EvalText), scored with its model alone in memory (eval
    loads the model after), then handed to it (`scored`); `bar`: a progress bar's label, or False."""
    from mha2gqa.scoring.agreement import reference_top

    model, found = reference.loaded(dtype, device), {}
    for name, text in texts.items():
        label = bar and f"{bar} · {name} · top tokens"
        result, top = reference_top(model, text.ids, context, stride, reference.top_k, progress=label)
        found[name] = DomainTops(result["nll_per_token"] * result["tokens_scored"], result["tokens_scored"], top)
    del model  # before the model under test is loaded (a reference in memory stays its owner's)
    reference.scored(found)
    return found
