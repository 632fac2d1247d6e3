"""`sweep --kv-budgets 0.5,0.75`: per-layer candidates beside the uniform ones, at equal KV bytes on the same plot.

A budget candidate is `convert --kv-budget X` (its plan's layer-losses stage: convert/layer_losses.py): each layer's kv-head count chosen by an
exact knapsack from each layer's measured loss, mean-pooled, written in the Nemotron-NAS format. The losses are
the expensive part (the parent rerun from every layer at every count), and they do not depend on the budget, so
the sweep measures them once, on the first BUDGET_BLOCKS blocks of its calibration text, and every budget chooses
from them. Each candidate is then evaluated against the parent like a uniform one; its row holds the counts.
"""

from __future__ import annotations

import time
from pathlib import Path

from mha2gqa.architecture.layouts import DTYPE_BYTES, AttentionShape
from mha2gqa.convert.counts import validate_per_layer_parent
from mha2gqa.convert.kv_budget import budget_heads
from mha2gqa.convert.layer_losses import MeasuredLosses, measure_for
from mha2gqa.convert.options import ConvertOptions
from mha2gqa.convert.prepare import ConversionPlan
from mha2gqa.sweep.candidates import Candidate
from mha2gqa.sweep.rows import BUDGET_METHOD

FLAG = "--kv-budgets"


def validate_budgets(budgets: tuple[str, ...], shape: AttentionShape, config: dict) -> None:
    """Every budget one the parent can meet (kv_budget.budget_heads), in a format the parent can be written in,
    refused by value before anything runs."""
    if budgets:
        validate_per_layer_parent(config, FLAG)
    for budget in budgets:
        budget_heads(budget, shape, DTYPE_BYTES[shape.dtype], FLAG)


def convert_options(options, budget: str) -> ConvertOptions:
    """A budget candidate's conversion options from the sweep's: its calibration text (the losses read it), its
    seed; the mean merge (the per-layer method of the sweep's table)."""
    return ConvertOptions(kv_budget=budget, calibration=options.calibration, seed=options.seed, progress=False,
                          check=False)  # fmt: skip


def plan_budgets(source: Path, budgets: list[Candidate], options, models_dir: Path) -> dict[Candidate, ConversionPlan]:
    """Each budget candidate checked and planned by convert (every refusal before the sweep writes anything); the
    plans price the candidates, and the first one's calibration is what the shared losses are measured on."""
    from mha2gqa.convert.run import plan_conversion

    return {c: plan_conversion(source, models_dir / c.name, convert_options(options, c.budget)) for c in budgets}


class SharedLosses:
    """The layer losses, measured when the first budget candidate needs them and kept for the others."""

    def __init__(self, plan: ConversionPlan):
        self.plan = plan
        self._measured: MeasuredLosses | None = None

    @property
    def measured(self) -> bool:
        return self._measured is not None

    def get(self) -> MeasuredLosses:
        if self._measured is None:
            self._measured = measure_for(self.plan)
        return self._measured


def measure_budget_candidate(source, budget: str, options, losses: SharedLosses, models_dir, parent, context) -> dict:
    """Convert at `budget` from the shared losses, time it, evaluate against the parent: the candidate's row."""
    import torch

    from mha2gqa.convert.run import execute, plan_conversion
    from mha2gqa.eval.memory import PeakMemory
    from mha2gqa.eval.run import evaluate
    from mha2gqa.sweep.candidates import derived_columns, eval_options

    name = Candidate(None, BUDGET_METHOD, budget).name
    dst = models_dir / name
    measured = losses.get()  # the first budget pays for them: not this candidate's conversion time
    started = time.perf_counter()
    with PeakMemory(torch.device("cpu")) as peak:
        plan = plan_conversion(source, dst, convert_options(options, budget), losses=measured)
        execute(plan, dst)
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
