"""`sweep --kv-budgets 0.5,0.75`: per-layer candidates beside the uniform ones, at equal KV bytes on the same plot.

A budget candidate is `convert --kv-budget X --method M` for each M of --methods (its plan's layer-losses stage:
convert/layer_losses.py): each layer's kv-head count chosen by an exact knapsack from each layer's measured loss,
merged by M (and refined with --refine), written in the Nemotron-NAS format. The losses are the expensive part (the
parent rerun from every layer at every count), and they do not depend on the budget, only on the merge (each layer
is converted as M converts it: layer_losses.merge_for), so the sweep measures them once per merge, on the first
blocks of its calibration text, and every candidate of that merge chooses from them; it is then converted and
evaluated like a uniform one (candidates.py), and its row holds the budget and the counts.
"""

from __future__ import annotations

from mha2gqa.architecture.layouts import DTYPE_BYTES, AttentionShape
from mha2gqa.convert.counts import validate_per_layer_parent
from mha2gqa.convert.kv_budget import budget_heads
from mha2gqa.convert.layer_losses import MeasuredLosses, measure_for, merge_key
from mha2gqa.convert.prepare import ConversionPlan

FLAG = "--kv-budgets"


def validate_budgets(budgets: tuple[str, ...], shape: AttentionShape, config: dict) -> None:
    """Every budget one the parent can meet (kv_budget.budget_heads), in a format the parent can be written in,
    refused by value before anything runs."""
    if budgets:
        validate_per_layer_parent(config, FLAG)
    for budget in budgets:
        budget_heads(budget, shape, DTYPE_BYTES[shape.dtype], FLAG)


class SharedLosses:
    """The layer losses, measured once per merge (the budget candidates of one --methods method share them: the
    losses convert each layer as the candidate's merge does, layer_losses.merge_for), all of them when the first
    budget candidate needs them, from the first plan of each merge and the sweep's statistics."""

    def __init__(self, plans: list[ConversionPlan], stats=None):
        self.plans = first_of_each_merge(plans)
        self.stats = stats
        self._measured: dict = {}

    @property
    def measured(self) -> bool:
        return bool(self._measured)

    def get(self, plan: ConversionPlan) -> MeasuredLosses:
        if not self._measured:
            self._measured = {key: measure_for(first, self.stats) for key, first in self.plans.items()}
        return self._measured[merge_key(plan.options)]


def first_of_each_merge(plans: list[ConversionPlan]) -> dict:
    """{merge: the first budget plan that merges so}: one loss measurement each (the sweep prices as many)."""
    found: dict = {}
    for plan in plans:
        found.setdefault(merge_key(plan.options), plan)
    return found
