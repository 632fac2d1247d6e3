"""Which query heads retrieve: each head's retrieval score on the probe's questions (eval --retrieval).

A head copies a fact when, at the position that predicts an answer token, its strongest attention lands on
that same token in the fact stated earlier (the retrieval score of Wu et al., ICLR 2025: under 5% of heads
score high, and masking them costs needle recall). The score of a head is the share of answer tokens for which
it does, teacher-forced, over the questions of at most MAX_LENGTH tokens: the attention maps of every layer are
held at once, (layers, heads, T, T). Measured on the parent, it names the heads a kv-head merge must not lose.
"""

from __future__ import annotations

import torch

from mha2gqa.runtime.progress import progress_bar
from mha2gqa.scoring.retrieval_items import HEADS_MAX_LENGTH, Item

MAX_LENGTH = HEADS_MAX_LENGTH  # defined torch-free, where the questions are: convert's plan prices the heads too
RETRIEVING = 0.1  # a head whose score is above this counts as a retrieval head (Wu et al.'s threshold)
TOP = 10  # heads listed in the result


def copy_hits(attentions: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(layers, heads) count of `rows` whose strongest attention is at their `targets`.

    attentions (layers, heads, T, T); rows, targets (k,): the query positions and the key positions they copy."""
    strongest = attentions[:, :, rows, :].argmax(-1)  # (layers, heads, k)
    return (strongest == targets.to(strongest.device)).sum(-1)


@torch.no_grad()
def head_scores(model, items: list[Item], device, bar: str | bool = False) -> torch.Tensor | None:
    """(layers, heads) retrieval scores over the items of at most MAX_LENGTH tokens; None without any. The model
    runs under eager attention (sdpa returns no maps) and is switched back afterwards."""
    asked = [i for i in items if i.length <= MAX_LENGTH and i.source >= 0]
    if not asked:
        return None
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    hits, tokens = 0, 0
    shown = progress_bar(len(asked), bar or "", bool(bar), unit="question", leave=False)
    try:
        for item in asked:
            ids = torch.tensor([item.prompt + item.answer], device=device)
            out = model(input_ids=ids, output_attentions=True, logits_to_keep=1)
            k = len(item.answer)
            rows = torch.arange(len(item.prompt) - 1, len(item.prompt) - 1 + k)  # each predicts answer[j]
            hits = hits + copy_hits(torch.stack(out.attentions)[:, 0], rows, item.source + torch.arange(k)).cpu()
            tokens += k
            shown.update()
    finally:
        model.set_attn_implementation(before)
        shown.close()
    return hits.float() / tokens


def heads_section(scores: torch.Tensor, kv_heads: int, questions: int) -> dict:
    """The result's retrieval.heads: every score, the TOP heads with their kv head, and how many retrieve."""
    layers, heads = scores.shape
    order = scores.flatten().argsort(descending=True)[:TOP].tolist()
    return {
        "questions": questions,
        "max_length": MAX_LENGTH,
        "retrieving": int((scores > RETRIEVING).sum()),
        "threshold": RETRIEVING,
        "heads": layers * heads,
        "top": [
            {
                "layer": n // heads,
                "head": n % heads,
                "kv_head": (n % heads) // max(1, heads // kv_heads),  # query head i reads kv head i // group
                "score": round(float(scores.flatten()[n]), 4),
            }
            for n in order
        ],
        "scores": [[round(float(v), 4) for v in row] for row in scores],
    }
