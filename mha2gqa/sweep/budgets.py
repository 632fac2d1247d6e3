"""`sweep --kv-budgets 0.5,0.75`: per-layer candidates beside the uniform ones, at equal KV bytes on the same plot.

A budget candidate is `convert --kv-budget X` (convert/budget_run.py): each layer's kv-head count chosen by an
exact knapsack from each layer's measured loss, mean-pooled, written in the Nemotron-NAS format. The losses are
the expensive part (the parent rerun from every layer at every count), and they do not depend on the budget, so
the sweep measures them once, on the first BUDGET_BLOCKS blocks of its calibration text, and every budget chooses
from them. Each candidate is then evaluated against the parent like a uniform one; its row holds the counts.
"""

from __future__ import annotations

import time
from pathlib import Path

from mha2gqa.convert.budget_run import MeasuredLosses, measure_losses, plan_at_budget
from mha2gqa.convert.kv_budget import budget_heads
from mha2gqa.convert.options import ConvertOptions
from mha2gqa.convert.per_layer import PerLayerPlan, execute_per_layer, plan_per_layer
from mha2gqa.layouts import DTYPE_BYTES, AttentionShape
from mha2gqa.sweep.candidates import Candidate
from mha2gqa.sweep.rows import BUDGET_METHOD

FLAG = "--kv-budgets"


def validate_budgets(budgets: tuple[str, ...], shape: AttentionShape) -> None:
    """Every budget one the parent can meet (kv_budget.budget_heads), refused by value before anything runs."""
    for budget in budgets:
        budget_heads(budget, shape, DTYPE_BYTES[shape.dtype], FLAG)


def convert_options(options) -> ConvertOptions:
    """The per-layer conversion's options from the sweep's: its calibration text (the losses read it), its seed."""
    return ConvertOptions(groups=1, calibration=options.calibration, seed=options.seed, progress=False, check=False)


def plan_parent(source: Path, dst: Path, shape: AttentionShape) -> PerLayerPlan:
    """A checked per-layer plan of the parent (one kv head a layer): every refusal a budget candidate can get
    (the parent's type, its MLP width in the format) comes before the sweep writes anything; the losses are
    measured through it, and its base plan prices each budget's mean conversion. Nothing is written at `dst`."""
    return plan_per_layer(source, dst, (1,) * shape.layers, ConvertOptions(groups=1, check=False))


class SharedLosses:
    """The layer losses, measured when the first budget candidate needs them and kept for the others."""

    def __init__(self, parent_plan: PerLayerPlan, options):
        self.parent_plan, self.options = parent_plan, options
        self._measured: MeasuredLosses | None = None

    @property
    def measured(self) -> bool:
        return self._measured is not None

    def get(self) -> MeasuredLosses:
        if self._measured is None:
            self._measured = measure_losses(self.parent_plan, convert_options(self.options))
        return self._measured


def measure_budget_candidate(source, budget: str, options, losses: SharedLosses, models_dir, parent, context) -> dict:
    """Convert at `budget` from the shared losses, time it, evaluate against the parent: the candidate's row."""
    import torch

    from mha2gqa.eval.memory import PeakMemory
    from mha2gqa.eval.run import evaluate
    from mha2gqa.sweep.candidates import derived_columns, eval_options

    name = Candidate(None, BUDGET_METHOD, budget).name
    dst = models_dir / name
    measured = losses.get()  # the first budget pays for them: not this candidate's conversion time
    started = time.perf_counter()
    with PeakMemory(torch.device("cpu")) as peak:
        plan = plan_at_budget(source, dst, budget, measured, convert_options(options))
        execute_per_layer(plan, dst)
    convert_s = time.perf_counter() - started
    started = time.perf_counter()
    result = evaluate(dst, options=eval_options(options, name, "converted", source))
    return {
        "name": name,
        "groups": None,
        "method": BUDGET_METHOD,
        "budget": budget,
        "kv_heads_per_layer": list(plan.counts),
        **derived_columns(result, parent, context),
        "convert_wall_s": round(convert_s, 3),
        "convert_peak_rss_bytes": peak.peak_bytes,
        "eval_wall_s": round(time.perf_counter() - started, 3),
        "model": str(dst) if options.keep else None,
        "merge_layers": None,
        "refine": None,
        "result": result,
    }
