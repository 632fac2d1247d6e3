"""A result's own reference, as a result of its own: what `report` compares one result with.

`mha2gqa eval MODEL --reference PARENT` scores the parent on the same windows and keeps its numbers in
MODEL's result file: its perplexity per domain (agreement.reference_perplexity), its decode speeds when
they were timed side by side (speed.side_by_side), and since 2026-12 its shape (reference.kv_heads, ...).
A report of that one file used to make the model its own baseline ("Baseline: gqa1", 1.00x everywhere);
it now puts the reference beside it, built here from those numbers. The reference's KV bytes per token are
its formula's (its live cache was not measured): from its recorded shape, or for an older result from the
model's own formula and the kv-head count its conversion record names.
"""

from __future__ import annotations

import copy

from mha2gqa.records import provenance


def reference_of(result: dict) -> dict | None:
    """The reference `result` was measured against, as a result dict with the numbers the file holds; None
    without a reference, or without any number of it (no --data: only agreement gives its perplexity)."""
    ref = result.get("reference") or {}
    if not ref or not any((d.get("agreement") or {}).get("reference_perplexity") for d in _domains(result).values()):
        return None
    model = dict(result["model"])
    model.update(path=ref.get("path"), resolved=ref.get("resolved"), provenance=None)
    model.update(
        {key: ref[key] for key in ("kv_heads", "heads", "layers", "head_dim", "params", "dtype") if key in ref}
    )
    model.setdefault("kv_heads", None)
    if "kv_heads" not in ref:
        model["kv_heads"] = _source_kv_heads(result, ref)
    return {
        "schema": result.get("schema"),
        "label": f"{ref.get('label') or 'reference'} (reference)",
        "role": "parent",
        "model": model,
        "reference": None,
        "data": copy.deepcopy(result.get("data")),
        "perplexity": _perplexity(result.get("perplexity"), result.get("agreement")),
        "agreement": None,
        "domains": {name: _domain(d) for name, d in _domains(result).items()} if result.get("domains") else None,
        "quality": None,
        "kv_cache": _kv_cache(result, ref, model["kv_heads"]),
        "speed": _speed(result),
        "attention_maps": None,
        "lm_eval": None,
        "warnings": [],
        "env": copy.deepcopy(result.get("env") or {}),
        "from_result_of": result.get("label"),
    }


def _domains(result: dict) -> dict:
    """{name: section} of every domain; a result without `domains` (older, one text) as one unnamed."""
    found = result.get("domains")
    if isinstance(found, dict) and found:
        return found
    return {
        "": {"data": result.get("data"), "perplexity": result.get("perplexity"), "agreement": result.get("agreement")}
    }


def _perplexity(mine: dict | None, agreement: dict | None) -> dict | None:
    """The reference's perplexity on the model's own windows (the same context, stride and tokens)."""
    if not mine or not (agreement or {}).get("reference_perplexity"):
        return None
    keep = ("context", "stride", "windows", "tokens_scored", "pooled_over")
    return {"perplexity": agreement["reference_perplexity"], **{k: mine[k] for k in keep if k in mine}}


def _domain(section: dict) -> dict:
    return {
        "data": copy.deepcopy(section.get("data")),
        "perplexity": _perplexity(section.get("perplexity"), section.get("agreement")),
        "agreement": None,
    }


def _source_kv_heads(result: dict, ref: dict) -> int | None:
    """An older result's reference kv heads: those of the model's conversion source, when its lineage names
    the reference as that source."""
    for stage in provenance.lineage_of((result.get("model") or {}).get("provenance")):
        if stage.get("stage") == "conversion" and stage.get("source") in (ref.get("path"), ref.get("resolved")):
            return stage.get("source_kv_heads")
    return None


def _kv_cache(result: dict, ref: dict, kv_heads: int | None) -> dict | None:
    """The reference's KV bytes per token by formula: recorded by eval, or the model's formula scaled by the
    kv-head counts (same layers, head_dim and dtype: a conversion keeps them)."""
    formula = ref.get("kv_formula_bytes_per_token")
    mine = result.get("kv_cache") or {}
    model_kv = (result.get("model") or {}).get("kv_heads")
    if formula is None and kv_heads and model_kv and mine.get("formula_bytes_per_token"):
        formula = mine["formula_bytes_per_token"] * kv_heads // model_kv
    if formula is None:
        return None
    return {"formula_bytes_per_token": formula, "measured_bytes_per_token": formula, "match": None, "by_formula": True}


def _speed(result: dict) -> dict | None:
    """The reference's decode speeds timed side by side with the model's, tagged with the same run id (so the
    speed-up is the one the table computes for side-by-side pairs); None when timed apart or not at all."""
    beside = ((result.get("speed") or {}).get("side_by_side")) or {}
    if not beside.get("points"):
        return None
    return {
        "grid": (result.get("speed") or {}).get("grid"),
        "points": copy.deepcopy(beside["points"]),
        "side_by_side": {"id": beside.get("id")},
    }
