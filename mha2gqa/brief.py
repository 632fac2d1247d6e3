"""Measured numbers in a few words, for the terminal summary of `eval` and the model card: both read
result files, and neither needs the report's table machinery (eval/metrics.py)."""

from __future__ import annotations


def lm_eval_brief(metric: str, m: dict) -> str:
    """One lm-eval metric in a line of text (terminal summary, model card): '0.075 ± 0.042', or a
    perplexity with its 95% interval, '8081 (95% 3012-2.17e+04)'; a perplexity without one alone."""
    if m.get("interval_95"):
        low, high = m["interval_95"]
        return f"{m['value']:.4g} (95% {low:.4g}-{high:.4g})"
    if m.get("stderr") is None or "perplexity" in metric:
        return f"{m['value']:.4g}"  # a bootstrapped ± of a perplexity says nothing (see lmeval.perplexity_intervals)
    return f"{m['value']:.4g} ± {m['stderr']:.2g}"
