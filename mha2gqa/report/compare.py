"""The comparison table's numbers, computed from result dicts (no rendering here).

The metrics themselves (what each column is, how it is computed) are entries of eval/metrics.py.
recovery = (ppl_converted - ppl_uptrained) / (ppl_converted - ppl_parent): 1 means uptraining won
back everything the conversion lost, 0 nothing. Each uptrained result is paired with its own
converted start and parent through the lineage (eval/lineage.py), whatever the order given.
"""

from __future__ import annotations

from mha2gqa.eval import lineage, metrics, schema
from mha2gqa.runtime.errors import InputError


def pick_baseline(results: list[dict], paths: list[str], baseline: str | None) -> int:
    """Index of the baseline: the first result, or the one whose label or path is `baseline`."""
    if baseline is None:
        return 0
    for i, (result, path) in enumerate(zip(results, paths)):
        if baseline in (result["label"], str(path)):
            return i
    labels = ", ".join(r["label"] for r in results)
    raise InputError(f"--baseline {baseline!r} is not the label or path of a given result (labels: {labels})")


def speed_point(results: list[dict]) -> tuple[int, int] | None:
    """(batch, context) measured by every result with speed: the largest batch, then context."""
    grids = [{(p["batch"], p["context"]) for p in r["speed"]["points"]} for r in results if r.get("speed")]
    if not grids:
        return None
    common = set.intersection(*grids)
    return max(common) if common else None


def comparison_rows(results: list[dict], base: int, speedup_apart: bool = False) -> tuple[list[dict], dict]:
    """One row per result, in the given order, with a value for every metric (metrics.METRICS, then
    one per lm-eval task metric); and what applies to the whole table: the baseline, the speed
    point, the notes, the columns' legend. speedup_apart: compute a speed-up from speeds timed in
    separate runs too (with a warning in the notes); by default only from speeds timed side by side."""
    point = speed_point(results)
    starts = lineage.recovery_starts(results)
    table = metrics.Table(results, base, point, starts, speedup_apart)
    entries = metrics.entries(results)
    rows = metrics.table_values(table, entries)
    notes = table_notes(results) + recovery_notes(results, starts) + speed_notes(results, rows, base)
    if any(row["speedup_noisy"] for row in rows):
        notes.append(
            "A speed-up marked noise is smaller than its uncertainty: with either model's median anywhere in its "
            "confidence interval (from the spread of its timed repeats) the ratio would cross 1, so none is claimed."
        )
    if len(results) == 1:  # nothing to compare with: no model is shown as its own baseline
        rows = [_without_comparisons(rows[0], entries)]
        notes.insert(0, NOTHING_TO_COMPARE)
    empty = [e.column.format(at="") for e in entries if e.column and not metrics.shown(e, rows)]
    if empty:
        notes.append(f"Left out, no result has a value: {', '.join(empty)}.")
    return rows, {
        "baseline": results[base]["label"] if len(results) > 1 else None,
        "speed_point": point,
        "notes": notes,
        "metrics": [entry.legend() for entry in entries],
    }


NOTHING_TO_COMPARE = (
    "Nothing to compare with: one result, measured without --reference, so no ratio, saving or speed-up is shown. "
    "Measure it against its parent (`mha2gqa eval MODEL --reference PARENT`), or report it beside other results."
)
# The values a lone result would get against itself (+0.0%, 1.00x): comparisons, left empty.
COMPARED = ("perplexity_change", "kv_saving", "speedup", "speedup_range", "speedup_noisy", "domains_ratio")


def _without_comparisons(row: dict, entries: list[metrics.Metric]) -> dict:
    row = dict(row)
    for entry in entries:
        name = entry.name
        if name in COMPARED or name.startswith("lm_eval_delta:"):
            row[name] = None
        elif name.startswith("domain:") and name.endswith(":perplexity") and row.get(name):
            row[name] = {**row[name], "ratio": None}
    return row


def recovery_notes(results: list[dict], starts: list[lineage.Start | None]) -> list[str]:
    """Why an uptrained row has no recovery: said in words instead of a number."""
    return [
        f"recovery of {r['label']}: not given, {start.missing} "
        "(pass the result files of the models it was converted from and uptrained from)"
        for r, start in zip(results, starts)
        if start is not None and start.missing
    ]


def table_notes(results: list[dict]) -> list[str]:
    """What makes numbers in the table not comparable, or not to be trusted, said in words."""
    notes = []
    data = {schema.data_digest(r) for r in results if r.get("perplexity")}
    if len(data) > 1:
        notes.append(
            "Perplexities were measured on different token streams (data or tokenizer differ): compare them with care."
        )
    windows = {schema.perplexity_window(r) for r in results if r.get("perplexity")}
    if len(windows) > 1:
        notes.append(f"Perplexities used different context/stride settings: {sorted(windows)}.")
    devices = {schema.device_name(r) for r in results if r.get("speed")}
    if len(devices) > 1:
        notes.append(f"Decode speeds were measured on different devices: {', '.join(sorted(map(str, devices)))}.")
    if sum(1 for r in results if r.get("speed")) > 1 and speed_point(results) is None:
        notes.append("No (batch, context) point was measured by every result: tokens/s is not compared.")
    timed = [r for r in results if schema.speed_points(r)]
    outside = [  # the plot draws tokens/s with their IQR bars for a lone timed result (else speed-ups)
        f"{r['label']} B={p['batch']} T={p['context']}"
        for r in (timed if len(timed) == 1 else [])
        for p in schema.speed_points(r)
        if (q := metrics.tokens_per_s_iqr(p)) and not q[0] <= p["tokens_per_s"] <= q[1]
    ]
    if outside:
        notes.append(
            f"The speed plot leaves out the interquartile bar of {', '.join(outside)}: the median lies outside its own "
            "interquartile range (a file edited or written inconsistently); the median is drawn alone."
        )
    for r in results:
        notes.extend(f"{r['label']}: {w}" for w in r.get("warnings") or [])
    return notes


def _timed(r: dict, row: dict) -> str:
    load = row.get("speed_load")
    when = (r.get("env") or {}).get("created")
    return (
        f"{r['label']}" + (f" at load {load[0]:.1f} on {load[1]} CPUs" if load else "") + (f", {when}" if when else "")
    )


def speed_notes(results: list[dict], rows: list[dict], base: int) -> list[str]:
    """Why a speed has no speed-up beside it, or why the one it has must be read with care."""
    timed = [i for i, row in enumerate(rows) if row["tokens_per_s"] is not None]
    if len(timed) < 2 or rows[base]["tokens_per_s"] is None:
        return []
    apart = [i for i in timed if i != base and rows[i]["speedup"] is None]
    warned = [i for i in timed if rows[i]["speedup_measured"] == "apart"]
    notes = []
    if apart:
        notes.append(
            "No speed-up for "
            + ", ".join(results[i]["label"] for i in apart)
            + " (in the table or the speed plot): each was timed in its own run, not side by side with the baseline, and a machine's load changes "
            "between runs (separate measurements: "
            + "; ".join(_timed(results[i], rows[i]) for i in [base, *apart])
            + "). Time them together with `mha2gqa eval MODEL --reference BASELINE --speed-side-by-side`, or pass "
            "`mha2gqa report --speedup-apart` to compute one anyway."
        )
    if warned:
        notes.append(
            "WARNING: the speed-ups of "
            + ", ".join(results[i]["label"] for i in warned)
            + " divide speeds timed apart (--speedup-apart), at different moments and loads ("
            + "; ".join(_timed(results[i], rows[i]) for i in [base, *warned])
            + "): the machine may have changed between them more than the models differ."
        )
    return notes
