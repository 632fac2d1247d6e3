"""A sweep's estimate: the parent evaluated once, the calibration pass once, then per candidate its conversion
(the statistics passed in) and its evaluation against the parent, costed by the parts of the commands they
run (mha2gqa.estimates)."""

from __future__ import annotations

from mha2gqa import estimates
from mha2gqa.convert.kv_budget import loss_tokens
from mha2gqa.estimates import EvalWork, Part, StageCost, combined
from mha2gqa.estimates.stages import SWEEP
from mha2gqa.sweep.budgets import first_of_each_merge

DEFAULT_CONTEXT = 1024  # eval's window when the sweep sets none (eval/run.py), each token scored once


def _texts(domains: list, max_tokens: int | None, context: int) -> dict:
    """{domain: (forward tokens, scored tokens)} from the texts' sizes, cut to max_tokens."""
    found = {}
    for i, entry in enumerate(domains):
        tokens = estimates.text_tokens(entry) or 0
        tokens = min(tokens, max_tokens) if max_tokens else tokens
        found[f"text {i + 1}"] = (tokens, max(0, tokens - -(-tokens // context)))
    return found


def sweep_stages(
    plans: dict, domains: list, max_tokens: int | None, calibration_tokens: int | None, budget_plans=()
) -> list[StageCost]:
    """The sweep's stages: start, the parent's evaluation, the one calibration pass (when a uniform candidate is
    left), the layer losses (once per merge of the --kv-budgets candidates' plans, `budget_plans`), then a stage
    per candidate (`plans`: {candidate name: its dry-run ConversionPlan}, each with the precision its plan decided;
    its calibration and layer losses are the sweep's, priced once above)."""
    parent, context, config = _parent_facts(plans)
    texts = _texts(domains, max_tokens, context)
    vocab = config.get("vocab_size") or 0
    parent_work = EvalWork(parent, None, vocab, 4 * parent, texts, 0)
    child = _candidate_evaluation(parent, vocab, texts)
    stages = [
        StageCost(SWEEP.start.name, (Part("torch_start", parent),)),
        StageCost(SWEEP.load.name, ()),
        combined(SWEEP.evaluate_parent.name, estimates.eval_stages(parent_work, start=False)),
    ]
    if calibration_tokens:
        stages.append(
            StageCost(SWEEP.calibrate.name, (Part("calibrate", parent, {"tokens": calibration_tokens * parent}),))
        )
    measured = list(first_of_each_merge(budget_plans).values())
    if measured:
        first = measured[0]
        tokens = len(measured) * loss_tokens(first.shape, first.loss_blocks * first.calibration.seq_len)
        stages.append(StageCost(SWEEP.layer_losses.name, (Part("calibrate", parent, {"tokens": tokens * parent}),)))
    for name, plan in plans.items():
        candidate = plan.priced(start=False, calibration=False)
        candidate += estimates.eval_stages(child, start=False, warm=True)  # after the parent's, in its process
        stages.append(combined(SWEEP.candidate.member(name), candidate))
    return stages


def sweep_peak_bytes(plans: dict) -> int:
    """The larger of a candidate's conversion (its dry run's peak) and an evaluation of it beside the parent, both
    held in the sweep's process, one window at a time."""
    from types import SimpleNamespace

    from mha2gqa.eval.batching import window_bytes

    parent, context, config = _parent_facts(plans)
    evaluation = _candidate_evaluation(parent, config.get("vocab_size") or 0, {})
    window = window_bytes(SimpleNamespace(**config), context, element_bytes=4)
    return max([estimates.eval_peak_bytes(evaluation, window, batch=1)] + [p.peak_memory for p in plans.values()])


def _parent_facts(plans: dict) -> tuple[int, int, dict]:
    """The parent's parameters, eval's window on it and its config: every candidate converts the same parent."""
    first = next(iter(plans.values()))
    context = min(DEFAULT_CONTEXT, first.config.get("max_position_embeddings") or DEFAULT_CONTEXT)
    return first.parameters, context, first.config


def _candidate_evaluation(parent: int, vocab: int, texts: dict) -> EvalWork:
    """A candidate evaluated against the parent, both held in float32 in the sweep's process."""
    return EvalWork(parent, parent, vocab, 8 * parent, texts, 0)


def sweep_clock(plans: dict, domains: list, options, echo, budget_plans=(), statistics: bool = True):
    """Says the sweep's estimate and returns the clock that times it: a real run probes with torch (its threads);
    a dry run with numpy, and gets no clock (NO_CLOCK). Either probes only when the sweep is long enough
    (estimates.for_this_machine)."""
    from mha2gqa.estimates.clock import NO_CLOCK, Clock
    from mha2gqa.runtime.errors import import_torch

    calibration = options.calibration_tokens if statistics else None  # budget candidates alone gather none
    stages = tuple(sweep_stages(plans, domains, options.max_tokens, calibration, budget_plans))
    priced = estimates.Estimate(stages, estimates.STORED, sweep_peak_bytes(plans))
    if options.dry_run:
        echo(estimates.for_this_machine(priced, "numpy").line())
        return NO_CLOCK
    import_torch()
    clock = Clock(echo=echo)
    clock.stage(SWEEP.load.name)
    fine = options.refine is not None  # refine's small products get their own probe
    clock.begin(lambda: estimates.for_this_machine(priced, "torch", fine))
    return clock
