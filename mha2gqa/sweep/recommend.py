"""What a sweep recommends: per method, the smallest KV cache within the tolerance of the parent, over several
domains the geometric mean of the perplexity ratios within it and no domain broken; when no candidate is, the
next step (next_step.py) from the closest one."""

from __future__ import annotations

from mha2gqa.eval.domains import geomean
from mha2gqa.sweep.next_step import uptrain_command
from mha2gqa.sweep.options import BROKEN_SLACK
from mha2gqa.sweep.rows import heads_text, methods_of

# A candidate good on average and broken on one domain (a conversion that fits its calibration text) is never
# recommended: BROKEN_SLACK (sweep/options.py) says what broken is.


def _ratios(row: dict, parent_ppl: float) -> dict[str, float]:
    """{domain: perplexity ratio to the parent}; one unnamed domain for a record written before domains."""
    return {n: d["ratio"] for n, d in (row.get("domains") or {}).items()} or {"data": row["perplexity"] / parent_ppl}


def verdict(row: dict, parent_ppl: float, tolerance: float) -> str | None:
    """None when the candidate may be recommended, else why not, in words."""
    ratios = _ratios(row, parent_ppl)
    cap = 1 + BROKEN_SLACK * tolerance
    broken = {n: r for n, r in ratios.items() if r > cap}
    if len(ratios) > 1 and broken:
        worst = max(broken, key=broken.get)
        return f"broken on {worst} ({broken[worst]:.2f}x the parent's, above {cap:.2f}x)"
    if len(ratios) == 1:  # one text: the rule it always had
        return None if row["perplexity"] <= parent_ppl * (1 + tolerance) else "outside the tolerance"
    return None if geomean(ratios.values()) <= 1 + tolerance else "outside the tolerance"


def recommend(record: dict) -> dict:
    """Per method, the smallest KV cache within the tolerance of the parent (over several domains: the
    geometric mean of the per-domain perplexity ratios within it, and no domain broken); when no candidate
    is, the uptraining command to try next, from the candidate of lowest perplexity (geometric mean)."""
    rows, settings = record["candidates"], record["settings"]
    tolerance, parent_ppl = settings["tolerance"], record["parent"]["perplexity"]
    several = any(len(r.get("domains") or {}) > 1 for r in rows)
    refused = {r["name"]: verdict(r, parent_ppl, tolerance) for r in rows}
    chosen = {}
    for method in methods_of(record):
        fits = [r for r in rows if r["method"] == method and refused[r["name"]] is None]
        chosen[method] = min(fits, key=lambda r: (r["kv_bytes_per_token"], _score(r)))["name"] if fits else None
    head = (
        f"geometric mean of the per-domain perplexity ratios within {100 * tolerance:g}% of the parent's, no domain "
        f"above {1 + BROKEN_SLACK * tolerance:.2f}x"
        if several
        else f"within {100 * tolerance:g}% of the parent's perplexity {parent_ppl:.2f}"
    )
    if not rows:
        summary = f"no candidate finished: nothing to recommend ({head})"
        return {"per_method": chosen, "next": None, "summary": summary, "line": summary, "refused": {}}
    parts = [f"{method}: " + (_chosen_text(rows, name, several) if name else "none") for method, name in chosen.items()]
    broken = {n: why for n, why in refused.items() if why and why.startswith("broken")}
    if broken:
        parts.append("refused " + ", ".join(f"{n} ({why})" for n, why in broken.items()))
    next_command = None
    if not any(chosen.values()):
        best = min(rows, key=lambda r: (_score(r), r["kv_bytes_per_token"]))
        next_command = uptrain_command(record, best)
        parts.append(f"none is: try uptraining the closest, {best['name']} ({_change(best, several)})")
    summary = f"recommended ({head}): " + "; ".join(parts)
    line = f"{summary}: {next_command}" if next_command else summary  # what the command prints: one line
    return {"per_method": chosen, "next": next_command, "summary": summary, "line": line, "refused": refused}


def _score(row: dict) -> float:
    """What ranks candidates: the geometric mean of the per-domain ratios, else (one text) the perplexity."""
    return row["domains_ratio"] if len(row.get("domains") or {}) > 1 else row["perplexity"]


def _change(row: dict, several: bool) -> str:
    if several and len(row.get("domains") or {}) > 1:
        return (
            f"{row['domains_ratio']:.2f}x on the geometric mean, worst {row['worst_domain']} {row['worst_ratio']:.2f}x"
        )
    return f"{100 * row['perplexity_change']:+.1f}%"


def _chosen_text(rows: list[dict], name: str, several: bool) -> str:
    row = next(r for r in rows if r["name"] == name)
    return f"{heads_text(row)} ({row['kv_saving']:g}x smaller KV, {_change(row, several)})"
