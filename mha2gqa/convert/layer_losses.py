"""The "layer losses" stage of a --kv-budget conversion: each layer's loss at each kv-head count, measured through
the loaded parent (sensitivity.py), then the counts chosen within the budget (kv_budget.choose_counts), which fill
the plan's counts before the merge. A sweep measures the losses once (measure_for) and passes them to every
budget's plan, which then only chooses.

A layer's loss at a count has two terms, both KL(parent || model) with only that layer converted to that count by
the conversion's own merge (merge_for: the calibrated merge with its maps folded into q_proj/o_proj where the plan
merges so, mean-pooling where it mean-pools; sensitivity.LayerMerge):
- text: per token of the calibration blocks (what perplexity sees);
- retrieval: per answer token of copy prompts built from the same calibration ids (scoring/copy_prompts.py: a span
  planted early, asked for at the end), which perplexity does not see: pooling a layer whose heads copy from far
  back loses the copy (docs/eval.md: SmolLM2's recall 47% -> 0% at 3 -> 1).
The knapsack weighs text + RETRIEVAL_WEIGHT x retrieval, and its choice is converted. Losses measured one layer
at a time do not add up, so the chosen placement and the text-only one (the knapsack without the retrieval term)
are then measured whole (all their layers pooled at once, both terms) and recorded: what the retrieval term costs
the text and buys the copies, in truth. Choosing by the whole losses instead was measured and rejected: on
SmolLM2 at 0.6667 the placement with the least whole loss kept 8% recall where the knapsack's kept 28%
(docs/convert.md, "The retrieval term, measured").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mha2gqa.architecture.layouts import AttentionShape, Layout
from mha2gqa.convert.kv_budget import FLAG, choice_lines, choose_counts
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.progress import progress_bar

LOSS = (
    "KL(parent || model) per token of the calibration blocks + retrieval_weight x KL per answer token of copy "
    "prompts built from them, with only this layer converted by the conversion's merge"
)
RETRIEVAL_WEIGHT = 1.0  # the retrieval term's weight in the knapsack (docs/convert.md: 0, 0.25 and 1 measured)
WHOLE_SCALES = (1.0, 0.0)  # x RETRIEVAL_WEIGHT: the placements measured whole, the first converted
COPY_PROMPT_BLOCKS = 2  # a copy prompt is this many calibration blocks long (at most the model's context)
COPY_PROMPTS = 4  # copy prompts at most (each plants up to 8 spans: scoring/copy_prompts.py)


@dataclass
class WholePlacements:
    """Measures placements whole: the parent (or how to load it) and the blocks and copy prompts it is scored on."""

    parent: Callable  # () -> the parent model: the loaded one, or a loader (a sweep's, which let it go)
    blocks: object  # (N, seq_len) calibration ids
    prompts: object  # (n, length) copy prompts
    scored: object  # (n, length - 1) their answer positions
    shape: AttentionShape
    layout: Layout
    merge: object = None  # sensitivity.LayerMerge: how each pooled layer is converted

    def measure(self, placements: list[tuple[int, ...]]) -> list[tuple[float, float]]:
        """(text, retrieval) KL of each placement, every layer converted to its count at once."""
        from mha2gqa.convert.sensitivity import placement_losses

        model = self.parent()
        text = placement_losses(model, self.layout, self.blocks, self.shape, placements, merge=self.merge)
        copy = (
            placement_losses(model, self.layout, self.prompts, self.shape, placements, self.scored, self.merge)
            if len(self.prompts)
            else None
        )
        return [(t, copy[k] if copy else 0.0) for k, t in enumerate(text)]


@dataclass(frozen=True)
class MeasuredLosses:
    """Each layer's loss at each kv-head count of a parent, measured once: every budget chooses from them."""

    losses: list[dict[int, float]]  # losses[layer][count]: text KL per token
    record: dict  # the calibration read and the merge measured with, for mha2gqa.json
    shape: AttentionShape
    retrieval: list[dict[int, float]] | None = None  # retrieval[layer][count]: KL per answer token of copy prompts
    whole: WholePlacements | None = field(default=None, compare=False)  # None: the knapsack's choice stands


def measure(parent, ids, plan, record: dict, load=None, stats=None) -> MeasuredLosses:
    """The losses on the plan's first loss blocks of `ids` (the calibration read: tokens of SRC's tokenizer), and
    copy prompts from the same ids, each layer converted by the plan's merge (its statistics: `stats`). `load`: how
    to load the parent again for the whole placements (a sweep's); None: `parent` stays referenced for them."""
    from mha2gqa.convert.sensitivity import layer_losses
    from mha2gqa.scoring.copy_prompts import copy_prompts

    shape, seq_len = plan.shape, plan.calibration.seq_len
    count = min(plan.loss_blocks, len(ids) // seq_len)
    if count < 1:
        raise InputError(
            f"{FLAG}: the calibration gave {len(ids)} tokens, less than one block of {seq_len}: "
            "give more text with --calibration, or raise --calibration-tokens"
        )
    blocks = ids[: count * seq_len].reshape(count, seq_len)
    length = copy_length(seq_len, getattr(parent.config, "max_position_embeddings", None))
    prompts, scored = copy_prompts(blocks.reshape(-1), length, COPY_PROMPTS)
    candidates = shape.valid_groups()
    bar = progress_bar(
        (count + len(prompts)) * shape.layers * (len(candidates) - 1), "layer losses", plan.options.progress
    )
    merge, merged_by = merge_for(plan.options, stats)
    losses = layer_losses(parent, plan.layout, blocks, shape, candidates, bar, merge=merge)
    retrieval = (
        layer_losses(parent, plan.layout, prompts, shape, candidates, bar, scored, merge) if len(prompts) else None
    )
    bar.close()
    kept = {key: value for key, value in record.items() if key not in ("blocks", "seq_len")}
    answers = int(scored.sum())
    record = dict(kept, blocks=count, seq_len=seq_len, copy_prompts=len(prompts), copy_length=length, answers=answers,
                  merge=merged_by)  # fmt: skip
    whole = WholePlacements(load or (lambda: parent), blocks, prompts, scored, shape, plan.layout, merge)
    return MeasuredLosses(losses, record, shape, retrieval, whole)


def merge_key(options) -> tuple:
    """What the losses depend on besides the parent and the calibration: the merge (method, grouping)."""
    return (options.method, options.grouping)


def merge_for(options, stats) -> tuple[object, str]:
    """How the losses convert a layer: as the conversion merges (its method and grouping, with the statistics it
    reads), and those words for the record. Mean-pooling with contiguous groups is pooled in place (no statistics).
    Why: the merge decides which layers lose most. On SmolLM2-135M the calibrated merge handles layer 0, the layer
    mean-pooling breaks most (docs/convert.md, "Layer losses through the merge"), so its budget goes elsewhere."""
    from mha2gqa.convert.methods import METHODS
    from mha2gqa.convert.options import Grouping, Method
    from mha2gqa.convert.sensitivity import LayerMerge

    if options.method == Method.MEAN and options.grouping == Grouping.CONTIGUOUS:
        return LayerMerge(), "mean"
    merge = LayerMerge(METHODS[options.method], options.grouping, stats, options.seed)
    return merge, f"{options.method.value}, {options.grouping.value} grouping"


def copy_length(seq_len: int, context) -> int:
    """A copy prompt's tokens: COPY_PROMPT_BLOCKS calibration blocks, at most the model's context."""
    length = COPY_PROMPT_BLOCKS * seq_len
    return min(length, context) if isinstance(context, int) and context > 0 else length


def measure_for(plan, stats=None) -> MeasuredLosses:
    """The losses of a budget plan's parent, measured on their own (a sweep's, once for all its budgets of one
    merge; `stats`: the sweep's statistics, which the merge may read). The parent is let go afterwards and loaded
    again by each budget's whole-placement check."""
    from mha2gqa.convert.calibration import load_source_model
    from mha2gqa.corpus.calibration import read_calibration

    options = plan.options
    parent = load_source_model(plan.source, plan.decided.device, progress=options.progress)
    ids, record = read_calibration(
        plan.calibration, plan.source, options.seed, lambda: parent, progress=options.progress
    )

    def load():
        return load_source_model(plan.source, plan.decided.device, progress=False)

    return measure(parent, ids, plan, record, load=load, stats=stats)


def weighed(measured: MeasuredLosses, scale: float = 1.0) -> list[dict[int, float]]:
    """Each layer's loss at each count as the knapsack weighs it: text + scale x RETRIEVAL_WEIGHT x retrieval."""
    if measured.retrieval is None:
        return measured.losses
    weight = scale * RETRIEVAL_WEIGHT
    return [{c: text[c] + weight * copy[c] for c in text} for text, copy in zip(measured.losses, measured.retrieval)]


def choose(plan, measured: MeasuredLosses) -> tuple[tuple[int, ...], dict]:
    """The counts with the least weighed loss (text + RETRIEVAL_WEIGHT x retrieval) within the plan's budget, and
    how they were chosen (mha2gqa.json), with this placement and the text-only one measured whole."""
    shape, heads = measured.shape, plan.budget_heads
    proposals: dict[tuple[int, ...], float] = {}
    for scale in WHOLE_SCALES if measured.retrieval is not None else (1.0,):
        proposals.setdefault(choose_counts(weighed(measured, scale), heads), scale)
    placements = list(proposals)
    counts = placements[0]
    whole = measured.whole.measure(placements) if measured.whole is not None else None
    losses = weighed(measured)
    chosen = {
        "budget": str(plan.options.kv_budget),
        "budget_kv_heads": heads,
        "kv_heads_used": sum(counts),
        "parent_kv_heads": shape.layers * shape.kv_heads,
        "loss": LOSS,
        "retrieval_weight": RETRIEVAL_WEIGHT if measured.retrieval is not None else None,
        "losses": _table(losses),
        "text_losses": _table(measured.losses),
        "retrieval_losses": _table(measured.retrieval) if measured.retrieval is not None else None,
        "predicted_loss": sum(losses[layer][count] for layer, count in enumerate(counts)),
        "whole": [_proposal(p, proposals[p], measured, whole and whole[k]) for k, p in enumerate(placements)],
        "calibration": measured.record,
    }
    return counts, chosen


def _objective(measured: tuple[float, float]) -> float:
    text, copy = measured
    return text + RETRIEVAL_WEIGHT * copy


def _proposal(counts, scale: float, measured: MeasuredLosses, whole) -> dict:
    """One placement the knapsack chose at a scale of the retrieval term: its summed terms, and measured whole."""
    text = sum(measured.losses[layer][c] for layer, c in enumerate(counts))
    copy = sum(measured.retrieval[layer][c] for layer, c in enumerate(counts)) if measured.retrieval else 0.0
    found = {"retrieval_scale": scale, "counts": list(counts), "predicted": {"text": text, "retrieval": copy}}
    if whole:
        found["measured"] = {"text": whole[0], "retrieval": whole[1], "loss": _objective(whole)}
    return found


def _table(losses: list[dict[int, float]]) -> list[dict[str, float]]:
    return [{str(count): loss for count, loss in sorted(per.items())} for per in losses]


def chosen_lines(plan) -> list[str]:
    """What convert prints about the budget's choice: the counts, their KV share, each layer's loss."""
    chosen = plan.chosen
    losses = [{int(c): v for c, v in per.items()} for per in chosen["losses"]]
    lines = choice_lines(plan.counts, losses, plan.shape, chosen["budget_kv_heads"])
    whole = [p for p in chosen.get("whole", []) if "measured" in p]
    if whole:
        lines.append(
            "measured whole (all pooled layers at once), text / retrieval KL: "
            + "; ".join(
                f"{'these counts' if p['counts'] == list(plan.counts) else 'text only'} "
                f"{p['measured']['text']:.4g} / {p['measured']['retrieval']:.4g}"
                for p in whole
            )
        )
    return lines
