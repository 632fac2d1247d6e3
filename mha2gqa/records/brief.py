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


def domain_lines(result: dict) -> list[str]:
    """One line per domain of an eval result (perplexity, and the ratio, KL and top-1 against the
    reference when there is one), then the geometric mean of the ratios."""
    lines = []
    for name, d in (result.get("domains") or {}).items():
        ppl, agree = (d.get("perplexity") or {}).get("perplexity"), d.get("agreement") or {}
        text = f"  {name}: perplexity {ppl:.3f} over {d['data']['tokens']:,} tokens"
        if agree:
            ratio = ppl / agree["reference_perplexity"]
            text += f" ({ratio:.3f}x the reference's), KL {agree['kl_mean']:.4f}, top-1 {100 * agree['top1_agreement']:.1f}%"
        lines.append(text)
    quality = result.get("quality") or {}
    if quality.get("geomean_perplexity_ratio") is not None:
        lines.append(
            f"  over {quality['domains']} domains: perplexity {quality['geomean_perplexity_ratio']:.3f}x the reference's "
            f"(geometric mean; worst {quality['worst_domain']} {quality['worst_ratio']:.3f}x)"
        )
    return lines


def domains_brief(result: dict) -> str | None:
    """Every domain of a result in one line (the model card): 'prose 12.31 (1.05x), code 4.20 (1.31x);
    geometric mean of the ratios to the reference 1.17x'; None for a result of one text."""
    per = result.get("domains") or {}
    if not isinstance(per, dict) or len(per) < 2:
        return None
    parts = []
    for name, d in per.items():
        ppl, agree = (d.get("perplexity") or {}).get("perplexity"), d.get("agreement") or {}
        if not isinstance(ppl, (int, float)):
            continue
        ref = agree.get("reference_perplexity")
        parts.append(f"{name} {ppl:.2f}" + (f" ({ppl / ref:.2f}x)" if isinstance(ref, (int, float)) and ref else ""))
    quality = result.get("quality") or {}
    mean = quality.get("geomean_perplexity_ratio")
    tail = f"; geometric mean of the ratios to the reference {mean:.2f}x" if isinstance(mean, (int, float)) else ""
    return ", ".join(parts) + tail
