"""The retrieval probe scored: does the model copy a fact from far back in its context (eval --retrieval)?

Perplexity on short windows does not see the few heads that copy from far back (retrieval heads, DESIGN.md
section 10); merging kv heads can lose them. Each question (scoring/retrieval_items.py) is forwarded once with
its answer appended, and two numbers come from that one pass:

- recall: the greedy continuation equals the answer. Teacher-forced, every answer token is the model's
  most likely next token exactly when greedy decoding from the prompt writes the answer, so no generation
  is needed;
- the answer's log-probability (the sum over its tokens); beside a reference, `answer_probability_kept` is
  exp(mean(model's - reference's)): the share of the parent's probability of the right answer the model
  keeps (1: all of it; above 1: more sure than the parent).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from mha2gqa.runtime.progress import progress_bar
from mha2gqa.scoring.retrieval_items import TASKS, Item, ProbeGrid


@torch.inference_mode()
def answer_scores(model, items: list[Item], device, bar: str | bool = False) -> list[tuple[float, bool]]:
    """(log-probability of the answer, whether greedy decoding writes it) for each item, one forward each."""
    found = []
    shown = progress_bar(sum(len(i.prompt) for i in items), bar or "", bool(bar), unit="tok", leave=False)
    for item in items:
        ids = torch.tensor([item.prompt + item.answer], device=device)
        keep = len(item.answer) + 1  # the last position predicts nothing asked
        logits = model(input_ids=ids, logits_to_keep=keep).logits[0, -keep:-1].float()
        target = torch.tensor(item.answer, device=logits.device)
        logprob = logits.log_softmax(-1).gather(1, target[:, None]).sum().item()
        found.append((logprob, bool((logits.argmax(-1) == target).all())))
        shown.update(len(item.prompt))
    shown.close()
    return found


def summarize(grid: ProbeGrid, items: list[Item], mine: list, reference: list | None) -> dict:
    """The result's `retrieval` section: overall, per task, per length, and per (task, length, depth) cell."""
    cells = defaultdict(list)
    for n, item in enumerate(items):
        cells[(item.task, item.length, item.depth)].append(n)

    def pooled(indices) -> dict:
        return _numbers(indices, mine, reference)

    by = {
        "tasks": {t: pooled([n for n, i in enumerate(items) if i.task == t]) for t in TASKS},
        "lengths": [{"length": n, **pooled([k for k, i in enumerate(items) if i.length == n])} for n in grid.lengths],
        "cells": [{"task": t, "length": n, "depth": d, **pooled(ks)} for (t, n, d), ks in cells.items()],
    }
    return {
        **pooled(range(len(items))),
        **by,
        "grid": {"lengths": list(grid.lengths), "depths": list(grid.depths), "samples": grid.samples},
        "seed": grid.seed,
        "haystack": "needle: the probe set's prose (Persuasion); kv: other keys' sentences",
    }


def _numbers(indices, mine: list, reference: list | None) -> dict:
    """recall and mean answer log-probability of some items, and the reference's beside them."""
    indices = list(indices)
    found = {
        "items": len(indices),
        "recall": sum(mine[k][1] for k in indices) / len(indices),
        "answer_logprob": sum(mine[k][0] for k in indices) / len(indices),
    }
    if reference is not None:
        gap = sum(mine[k][0] - reference[k][0] for k in indices) / len(indices)
        found.update(
            reference_recall=sum(reference[k][1] for k in indices) / len(indices),
            reference_answer_logprob=sum(reference[k][0] for k in indices) / len(indices),
            answer_probability_kept=math.exp(gap),
        )
    return found
