"""A sweep's estimate: the parent evaluated once, the calibration pass once, then per candidate its conversion
(the statistics passed in) and its evaluation against the parent, costed by the parts of the commands they
run (mha2gqa.estimates)."""

from __future__ import annotations

from mha2gqa import estimates
from mha2gqa.estimates import EvalWork, Part, StageCost, combined

DEFAULT_CONTEXT = 1024  # eval's window when the sweep sets none (eval/run.py), each token scored once


def _texts(domains: list, max_tokens: int | None, context: int) -> dict:
    """{domain: (forward tokens, scored tokens)} from the texts' sizes, cut to max_tokens."""
    found = {}
    for i, entry in enumerate(domains):
        tokens = estimates.text_tokens(entry) or 0
        tokens = min(tokens, max_tokens) if max_tokens else tokens
        found[f"text {i + 1}"] = (tokens, max(0, tokens - -(-tokens // context)))
    return found


def sweep_stages(plans: list, domains: list, max_tokens: int | None, calibration_tokens: int) -> list[StageCost]:
    first = plans[0]
    parent = estimates.parameters_of(first)
    context = min(DEFAULT_CONTEXT, first.config.get("max_position_embeddings") or DEFAULT_CONTEXT)
    texts = _texts(domains, max_tokens, context)
    vocab = first.config.get("vocab_size") or 0
    parent_work = EvalWork(parent, None, vocab, 4 * parent, texts, 0)
    stages = [
        StageCost("start", (Part("torch_start", parent),)),
        combined("evaluate parent", estimates.eval_stages(parent_work, start=False)),
        StageCost("calibrate", (Part("calibrate", parent, {"tokens": calibration_tokens * parent}),)),
    ]
    for plan in plans:
        child = EvalWork(parent, parent, vocab, 8 * parent, texts, 0)
        candidate = estimates.convert_stages(plan, start=False, calibration=False)
        candidate += estimates.eval_stages(child, start=False)
        stages.append(combined(f"candidate {plan.options.groups} kv, {plan.options.method}", candidate))
    return stages


def sweep_start_line(plans: list, domains: list, max_tokens: int | None, calibration_tokens: int) -> str:
    """The line a sweep prints before it starts, from its candidates' dry-run plans."""
    machine = estimates.this_machine("numpy")
    estimate = estimates.Estimate(tuple(sweep_stages(plans, domains, max_tokens, calibration_tokens)), machine)
    return "sweep: " + estimate.line()
