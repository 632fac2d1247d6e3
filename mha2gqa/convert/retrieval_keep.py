"""--keep-retrieval-heads: find the parent's retrieval heads, and merge so that the kv heads they read survive.

A retrieval head copies a fact from far back in the context (DESIGN.md section 10; Wu et al., ICLR 2025): few
heads do, perplexity does not see them, and a merge that averages the kv head such a head reads with others can
lose the copy (SmolLM2 3 -> 1 mean or calibrated: retrieval recall 47% -> 0%, docs/eval.md). So, before the merge:

- score: each query head of SRC on the retrieval probe's questions (scoring/retrieval_items.py,
  scoring/retrieval_heads.py: the share of answer tokens whose strongest attention lands on the fact's copy),
  with a novel of the embedded corpus as the haystack and a seed of its own, so the questions are not eval's;
- weigh: each kv head's retrieval mass is the summed score of the query heads it serves that retrieve (score
  above RETRIEVING); in its group's merge it weighs 1 + weight x that mass (1 for a layer without any), so the
  mean leans toward it and the calibrated merge fits its keys and values first;
- spread: with more than one group, the kv heads with a mass go to different groups where there are enough
  groups (a permutation of kv heads with their query heads: exact), so two retrieval kv heads are not averaged
  together. Where a layer has more such kv heads than groups (SmolLM2 at 1 group), they share one: the record
  and the terminal say which layers.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mha2gqa.convert.options import Method
from mha2gqa.corpus.tokens import validate_ids
from mha2gqa.files.embedded import novel_path
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.units import counted
from mha2gqa.scoring.retrieval_items import ProbeGrid, build_items

if TYPE_CHECKING:
    import torch

# Torch-free at import (prepare plans with it): torch and the head scorer are imported where they are used.
DEFAULT_RETRIEVAL_WEIGHT = 8.0  # a head of score 0.5 weighs 5x an ordinary one in its group (docs/eval.md)
RETRIEVAL_WEIGHTED = (Method.MEAN.value, Method.MEAN_NORM.value, Method.CALIBRATED.value)  # merges that take weights
RETRIEVING = 0.1  # scoring/retrieval_heads.py's threshold (Wu et al.'s), tested equal there
SCORE_LENGTHS = (128, 512)  # questions short enough to hold every attention map (retrieval_heads.MAX_LENGTH)
SCORE_DEPTHS = (0.1, 0.5, 0.9)
SCORE_SAMPLES = 4  # 48 questions: 2 tasks x 2 lengths x 3 depths x 4
SCORE_SEED_OFFSET = 7919  # the questions' seed is --seed + this: never eval's questions at the same seed
HAYSTACK_NOVEL = "northangerabbey"  # a training novel of the embedded corpus: not the probe set's Persuasion
SPREAD_COST = 4.0  # two retrieval kv heads in one group cost more than any two heads' similarity (at most 2)


def weight_of(options) -> float:
    """The merge's weight of a ConvertOptions with --keep-retrieval-heads (its default where unset)."""
    return DEFAULT_RETRIEVAL_WEIGHT if options.retrieval_weight is None else float(options.retrieval_weight)


def keep_line(options, counts: tuple[int, ...]) -> str:
    """The plan's line: what the option will do, and that one group cannot keep retrieval kv heads apart."""
    line = (
        "retrieval heads: SRC's query heads scored first on the retrieval probe (eager attention), the kv heads they "
        f"read weigh 1 + {weight_of(options):g} x their score in the merge"
    )
    if max(counts) == 1:
        return line + "; with 1 group, retrieval heads that read different kv heads share the one kv head"
    groups = str(counts[0]) if len(set(counts)) == 1 else "each layer's"
    return line + f"; retrieval kv heads spread over the {groups} groups where there are enough"


def validate_weight(keep: bool, weight: float | None) -> None:
    """--retrieval-weight's value, and that it comes with --keep-retrieval-heads."""
    if weight is None:
        return
    if not keep:
        raise InputError("--retrieval-weight needs --keep-retrieval-heads: add it, or leave --retrieval-weight out")
    if not math.isfinite(weight) or weight < 0:
        raise InputError(
            f"--retrieval-weight {weight} must be a finite number of at least 0 (0: score and spread only; "
            f"default {DEFAULT_RETRIEVAL_WEIGHT:g})"
        )


@dataclass(frozen=True)
class KeptHeads:
    """SRC's retrieval scores and what the merge does with them."""

    scores: torch.Tensor  # (layers, query heads) float
    kv_heads: int
    counts: tuple[int, ...]  # each layer's kv heads after the merge (its groups)
    weight: float
    questions: int

    def masses(self, layer: int) -> torch.Tensor:
        """(kv_heads,) the summed score of the retrieving query heads each kv head serves."""
        import torch

        row = self.scores[layer].double()
        per_kv = row.shape[0] // self.kv_heads  # query head i reads kv head i // per_kv
        return torch.where(row > RETRIEVING, row, torch.zeros_like(row)).reshape(self.kv_heads, per_kv).sum(1)

    def weights(self, layer: int) -> torch.Tensor | None:
        """(kv_heads,) each kv head's weight in its group's merge; None for a layer without retrieval heads."""
        masses = self.masses(layer)
        return None if not bool((masses > 0).any()) else 1.0 + self.weight * masses

    def shared_layers(self) -> list[int]:
        """The layers whose retrieval kv heads outnumber the groups: some must share a group."""
        return [n for n in range(self.scores.shape[0]) if int((self.masses(n) > 0).sum()) > self.counts[n]]

    def record(self) -> dict:
        """mha2gqa.json's retrieval_heads: the option, every retrieving head, and the layers that share."""
        layers, heads = self.scores.shape
        per_kv = heads // self.kv_heads
        found = [
            {"layer": n, "head": h, "kv_head": h // per_kv, "score": round(float(self.scores[n, h]), 4)}
            for n in range(layers)
            for h in range(heads)
            if self.scores[n, h] > RETRIEVING
        ]
        return {
            "weight": self.weight,
            "questions": self.questions,
            "haystack": HAYSTACK_NOVEL,
            "threshold": RETRIEVING,
            "retrieving": len(found),
            "heads": layers * heads,
            "found": sorted(found, key=lambda x: -x["score"]),
            "shared_layers": self.shared_layers(),
        }

    def summary_line(self) -> str:
        rec = self.record()
        layers = sorted({x["layer"] for x in rec["found"]})
        if not layers:
            return (
                f"retrieval heads: none of the {rec['heads']} query heads of SRC scores above {RETRIEVING} "
                f"({rec['questions']} questions): the merge is the plain one"
            )
        line = (
            f"retrieval heads: {rec['retrieving']} of {rec['heads']} query heads of SRC score above {RETRIEVING} "
            f"({rec['questions']} questions), in {len(layers)} layers; their kv heads weigh 1 + {self.weight:g} x "
            "their score in their group's merge"
        )
        shared = rec["shared_layers"]
        if shared:
            line += (
                f"; in {counted(len(shared), 'layer')} ({', '.join(map(str, shared))}) they read more kv heads than "
                f"the {_groups_words(self.counts, shared)}: those share a group, weighted, not kept apart"
            )
        return line


def _groups_words(counts: tuple[int, ...], layers: list[int]) -> str:
    found = sorted({counts[n] for n in layers})
    return counted(found[0], "group") if len(found) == 1 else "groups of those layers"


def score_parent(
    model, tokenizer, counts: tuple[int, ...], weight: float, seed: int, progress: bool = True
) -> KeptHeads:
    """SRC's retrieval heads, scored on its own probe questions (at most its max_position_embeddings long)."""
    from mha2gqa.scoring.retrieval_heads import head_scores

    config = model.config
    grid = scoring_grid(config.to_dict(), seed)
    limit = getattr(config, "max_position_embeddings", None)
    items = build_items(tokenizer, grid, _haystack())
    highest = max(max(item.prompt + item.answer) for item in items)
    validate_ids(highest, config.vocab_size, "--keep-retrieval-heads (the retrieval probe's questions)", "SRC")
    device = next(model.parameters()).device
    scores = head_scores(model, items, device, bar="retrieval heads" if progress else False)
    if scores is None:
        raise InputError(
            f"--keep-retrieval-heads: SRC's max_position_embeddings={limit} leaves no question to score its heads on"
        )
    return KeptHeads(scores.cpu(), config.num_key_value_heads, tuple(counts), weight, len(items))


def scoring_grid(config: dict, seed: int) -> ProbeGrid:
    """The questions SRC's heads are scored on: SCORE_LENGTHS up to its max_position_embeddings (that length alone
    where all are longer), seeded apart from eval's questions."""
    limit = config.get("max_position_embeddings") or max(SCORE_LENGTHS)
    lengths = tuple(n for n in SCORE_LENGTHS if n <= limit) or (limit,)
    return ProbeGrid(lengths, SCORE_DEPTHS, SCORE_SAMPLES, seed + SCORE_SEED_OFFSET)


def _haystack() -> str:
    with gzip.open(novel_path(HAYSTACK_NOVEL), "rt", encoding="utf-8") as f:
        return " ".join(f.read().split())


def spread_order(masses: torch.Tensor, groups: int, similarity: torch.Tensor | None = None) -> list[int] | None:
    """The kv heads' new order that puts retrieval kv heads (mass > 0) in different groups where possible,
    added to `similarity`'s pair costs when given; None when contiguous groups already do as well."""
    from mha2gqa.convert.grouping import partition

    clash = masses[:, None] * masses[None, :]
    clash.fill_diagonal_(0)
    clash = (clash > 0).double() * SPREAD_COST
    if similarity is None and _within(clash, list(range(len(masses))), groups) == 0:
        return None
    costs = clash if similarity is None else similarity + clash
    return [head for group in partition(costs, groups) for head in group]


def _within(costs: torch.Tensor, order: list[int], groups: int) -> float:
    size = len(order) // groups
    return sum(float(costs[g][:, g].sum()) for g in (order[i : i + size] for i in range(0, len(order), size)))
