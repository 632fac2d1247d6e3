"""The sweep's candidates (kv-head count x method, and --kv-budgets value x method): which to try, each one's plan,
conversion and measurement.

Every candidate is checked and planned by convert itself (prepare, the dry run) before anything is written;
the calibration is resolved once, by the first plan, and every other plan and every conversion reads that
resolution. A candidate is then converted with the statistics gathered once and evaluated against the parent.
The KL and top-1 agreement come from eval's own pass, which runs the parent beside the candidate over the
same windows: caching the parent's full next-token distributions instead would take tokens x vocabulary
floats (GBs for a real model), so the parent runs once per candidate there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.architecture.layouts import AttentionShape
from mha2gqa.convert.check import verdict
from mha2gqa.convert.options import ConvertOptions
from mha2gqa.eval import metrics, schema
from mha2gqa.eval.domains import geomean
from mha2gqa.runtime.errors import InputError
from mha2gqa.sweep.options import SweepOptions
from mha2gqa.sweep.rows import OWN_COLUMNS, budget_method


@dataclass(frozen=True)
class Candidate:
    """A uniform candidate (kv-head count x method), or with `budget` a per-layer one (sweep/budgets.py): the
    counts its budget's layer losses choose, merged by `method`."""

    groups: int | None
    method: str
    budget: str | None = None

    @property
    def name(self) -> str:
        return f"budget{self.budget}-{self.method}" if self.budget is not None else f"kv{self.groups}-{self.method}"

    @property
    def method_column(self) -> str:
        """sweep.json's method column: the method, or a budget's 'per-layer <method>' (its own line on the plot)."""
        return budget_method(self.method) if self.budget is not None else self.method


def kv_head_counts(shape: AttentionShape, wanted: tuple[int, ...] | None, echo=print) -> list[int]:
    """The kv-head counts to try, largest first: every divisor of the source's kv heads below it, or those
    of `wanted` that are (the others are named and skipped)."""
    valid = [g for g in shape.valid_groups() if g < shape.kv_heads]
    if wanted is None:
        chosen = valid
    else:
        chosen = [g for g in dict.fromkeys(wanted) if g in valid]
        skipped = [g for g in dict.fromkeys(wanted) if g not in valid]
        if skipped and chosen:
            echo(f"note: skipping --groups {','.join(map(str, skipped))}: not a divisor of {shape.kv_heads} below it")
    if not chosen:
        asked = "" if wanted is None else f"--groups {','.join(map(str, wanted))} leaves "
        raise InputError(
            f"{asked}no kv-head count to try: a candidate must divide the source's {shape.kv_heads} kv heads and be "
            f"below it (valid: {', '.join(map(str, valid)) or 'none, the source has one kv head already'})"
        )
    return sorted(chosen, reverse=True)


def _conversion_options(candidate: Candidate, options: SweepOptions, planned: bool) -> ConvertOptions:
    """The candidate's convert request: planned (the dry run) from the sweep's calibration text, converted from
    the statistics gathered once (convert's `stats`), so no calibration text of its own; a budget candidate's
    counts come from the layer losses the sweep measured once (convert's `losses`)."""
    return ConvertOptions(
        groups=candidate.groups,
        kv_budget=candidate.budget,
        method=candidate.method,
        seed=options.seed,
        calibration=options.calibration if planned else None,
        calibration_tokens=options.calibration_tokens,
        refine=options.refine,
        dry_run=planned,
        progress=False,
        check=False,  # the sweep's own evaluation gives the check's verdict (check_verdict), not a second pass
    )


def plan_candidates(source: Path, candidates: list[Candidate], options: SweepOptions, models_dir: Path) -> dict:
    """{candidate: its ConversionPlan}, each checked by convert itself before anything is written; the first
    resolves the calibration, the others read that resolution."""
    from mha2gqa.convert.run import plan_conversion

    plans, resolved = {}, None
    for c in candidates:
        plans[c] = plan_conversion(source, models_dir / c.name, _conversion_options(c, options, True), None, resolved)
        resolved = resolved or plans[c].calibration
    return plans


def convert_candidate(source: Path, dst: Path, candidate: Candidate, options: SweepOptions, shared: tuple):
    """The candidate converted by convert's own executor, from what the sweep measured once: `shared` = (the
    statistics, their resolved calibration text (refine's blocks come from the statistics' ids), the layer losses
    (a budget candidate's; None otherwise))."""
    from mha2gqa.convert.run import execute, plan_conversion

    stats, calibration, losses = shared
    convert_options = _conversion_options(candidate, options, planned=False)
    return execute(plan_conversion(source, dst, convert_options, stats, calibration, losses), dst)


def eval_options(options: SweepOptions, label: str, role: str, reference: Path | None = None):
    from mha2gqa.eval.options import EvalOptions

    return EvalOptions(
        data=options.data,
        reference=str(reference) if reference else None,
        max_tokens=options.max_tokens,
        speed_preset=None,
        role=role,
        label=label,
        seed=options.seed,
        retrieval=options.retrieval,
        progress=False,
    )


def kv_columns(result: dict, context: int | None) -> dict:
    per_token = schema.kv_bytes_per_token(result)
    return {"kv_bytes_per_token": per_token, "kv_bytes_per_sequence": per_token * context if context else None}


def measure_candidate(source, candidate, options, shared: tuple, models_dir, parent, context) -> dict:
    """Convert (from `shared`: convert_candidate's), measure the conversion's wall time and peak memory, evaluate
    against the parent: the candidate's row of sweep.json (a budget candidate's with its budget and counts)."""
    import torch

    from mha2gqa.eval.memory import PeakMemory
    from mha2gqa.eval.run import evaluate

    dst = models_dir / candidate.name
    started = time.perf_counter()
    with PeakMemory(torch.device("cpu")) as peak:
        converted = convert_candidate(source, dst, candidate, options, shared)
    convert_s = time.perf_counter() - started
    started = time.perf_counter()
    result = evaluate(dst, options=eval_options(options, candidate.name, "converted", source))
    eval_s = time.perf_counter() - started
    return {
        "name": candidate.name,
        "groups": candidate.groups,
        "method": candidate.method_column,
        **_budget_columns(candidate, converted),
        **derived_columns(result, parent, context),
        "convert_wall_s": round(convert_s, 3),
        "convert_peak_rss_bytes": peak.peak_bytes,
        "eval_wall_s": round(eval_s, 3),
        "model": str(dst) if options.keep else None,
        "merge_layers": converted.layers,
        "refine": converted.refine,
        "result": result,
    }


def _budget_columns(candidate: Candidate, converted) -> dict:
    """A budget candidate's budget and the counts its layer losses chose (none for a uniform candidate)."""
    if candidate.budget is None:
        return {}
    return {"budget": candidate.budget, "kv_heads_per_layer": list(converted.plan.counts)}


def derived_columns(result: dict, parent: dict, context: int | None) -> dict:
    """The columns of a candidate's row that follow from its eval result and the parent's: per domain, the
    main metrics, the KV bytes of a sequence (--resume derives them again to check a recorded row)."""
    domains = _domain_columns(result, parent)
    return {
        **domains,
        **metric_values(result, parent),
        "kv_bytes_per_sequence": kv_columns(result, context)["kv_bytes_per_sequence"],
        "check": check_verdict(domains["domains"]),
    }


def check_verdict(domains: dict) -> str | None:
    """convert's check, read off the sweep's own evaluation (the same scorer on the sweep's texts) instead of
    run again at each conversion: its verdict from each domain's perplexity ratio (convert/check.py)."""
    return verdict({name: d["ratio"] for name, d in domains.items()}).kind if domains else None


def parent_row(result: dict, context: int | None) -> dict:
    """sweep.json's parent entry: its eval result, with the numbers every candidate is compared with."""
    return {
        "perplexity": schema.perplexity(result),
        "domains": {name: d["perplexity"]["perplexity"] for name, d in (result.get("domains") or {}).items()},
        **kv_columns(result, context),
        "result": result,
    }


def metric_values(result: dict, parent: dict) -> dict:
    """The report's main metrics of a candidate against the parent (eval/metrics.py METRICS: a metric added
    there is measured here and shown in the table with no change to the sweep), those with a value."""
    row = metrics.row_against(result, parent)
    return {
        m.name: row[m.name]
        for m in metrics.METRICS + metrics.RETRIEVAL  # the probe's columns have values only with --retrieval
        if m.column and m.name not in OWN_COLUMNS and row[m.name] is not None
    }


def _domain_columns(result: dict, parent: dict) -> dict:
    """Per domain of --data: the candidate's perplexity, its ratio to the parent's on the same text, KL and
    top-1; with the geometric mean of the ratios and the worst domain (recommend reads these)."""
    domains = {}
    for name, d in (result.get("domains") or {}).items():
        ppl = d["perplexity"]["perplexity"]
        agreement = d.get("agreement") or {}
        domains[name] = {
            "perplexity": ppl,
            "ratio": ppl / parent["domains"][name]["perplexity"]["perplexity"],
            "kl_mean": agreement.get("kl_mean"),
            "top1_agreement": agreement.get("top1_agreement"),
        }
    ratios = {name: d["ratio"] for name, d in domains.items()}
    worst = max(ratios, key=ratios.get) if ratios else None
    return {
        "domains": domains,
        "domains_ratio": geomean(ratios.values()),
        "worst_domain": worst,
        "worst_ratio": ratios.get(worst),
    }
