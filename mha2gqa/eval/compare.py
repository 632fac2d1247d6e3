"""The comparison table's numbers, computed from result dicts (no rendering here).

recovery = (ppl_converted - ppl_uptrained) / (ppl_converted - ppl_parent): 1 means uptraining won
back everything the conversion lost, 0 nothing. It uses the first parent and the first converted
result given, and is shown only for uptrained rows.
"""

from __future__ import annotations

from mha2gqa.errors import InputError
from mha2gqa.eval import schema


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


def tokens_per_s(result: dict, point: tuple[int, int] | None) -> float | None:
    for p in schema.speed_points(result):
        if point is not None and (p["batch"], p["context"]) == point:
            return p["tokens_per_s"]
    return None


def _ratio(a, b):
    return a / b if a is not None and b else None


def comparison_rows(results: list[dict], base: int) -> tuple[list[dict], dict]:
    """One row per result, in the given order; and notes that apply to the whole table."""
    point = speed_point(results)
    ppl = [schema.perplexity(r) for r in results]
    kv = [schema.kv_bytes_per_token(r) for r in results]
    tps = [tokens_per_s(r, point) for r in results]
    parent = next((p for r, p in zip(results, ppl) if r["role"] == "parent" and p is not None), None)
    converted = next((p for r, p in zip(results, ppl) if r["role"] == "converted" and p is not None), None)
    rows = []
    for i, r in enumerate(results):
        recovery = None
        if r["role"] == "uptrained" and None not in (parent, converted, ppl[i]) and converted != parent:
            recovery = (converted - ppl[i]) / (converted - parent)
        change = _ratio(ppl[i], ppl[base])
        rows.append(
            {
                "label": r["label"],
                "role": r["role"],
                "heads": r["model"]["heads"],
                "kv_heads": r["model"]["kv_heads"],
                "perplexity": ppl[i],
                "perplexity_change": None if change is None else change - 1.0,
                "recovery": recovery,
                "kl_mean": schema.kl_mean(r),
                "top1_agreement": schema.top1_agreement(r),
                "kv_bytes_per_token": kv[i],
                "kv_saving": _ratio(kv[base], kv[i]),
                "kv_match": schema.kv_match(r),
                "tokens_per_s": tps[i],
                "speedup": _ratio(tps[i], tps[base]),
            }
        )
    lm_columns = add_lm_eval(rows, results, base)
    return rows, {
        "baseline": results[base]["label"],
        "speed_point": point,
        "notes": table_notes(results),
        "lm_eval": lm_columns,
    }


def add_lm_eval(rows: list[dict], results: list[dict], base: int) -> list[dict]:
    """One column per lm-eval task metric any result has: row["lm_eval:TASK:METRIC"] = {value, stderr}
    and row["lm_eval_delta:TASK:METRIC"] = value - the baseline's (a ratio - 1 for perplexities,
    whose scale is multiplicative). Returns the columns in first-seen order."""
    columns: dict[str, dict] = {}
    for r in results:
        for task, section in schema.lm_eval_tasks(r).items():
            for metric, found in (section.get("metrics") or {}).items():
                columns.setdefault(
                    f"{task}:{metric}",
                    {
                        "task": task,
                        "metric": metric,
                        "higher_is_better": found.get("higher_is_better"),
                        "relative": "perplexity" in metric,
                    },
                )

    def cell(r, key):
        return schema.lm_eval_metric(r, columns[key]["task"], columns[key]["metric"])

    for key, c in columns.items():
        base_cell = cell(results[base], key)
        for row, r in zip(rows, results):
            found = cell(r, key)
            row[f"lm_eval:{key}"] = None if found is None else {"value": found["value"], "stderr": found.get("stderr")}
            delta = None
            if found is not None and base_cell is not None:
                if c["relative"]:
                    ratio = _ratio(found["value"], base_cell["value"])
                    delta = None if ratio is None else ratio - 1.0
                else:
                    delta = found["value"] - base_cell["value"]
            row[f"lm_eval_delta:{key}"] = delta
        # Accuracies and the like are shown in percent; any other scale (bits per byte ...) as is.
        values = [row[f"lm_eval:{key}"]["value"] for row in rows if row[f"lm_eval:{key}"]]
        c["percent"] = not c["relative"] and all(0 <= v <= 1 for v in values)
    return [{"key": k, **c} for k, c in columns.items()]


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
    for r in results:
        notes.extend(f"{r['label']}: {w}" for w in r.get("warnings") or [])
    return notes
