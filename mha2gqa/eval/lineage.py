"""What an uptrained result's recovery is measured against: its own converted start and that start's
parent, found through the lineage every result carries (`model.provenance`, the model's mha2gqa.json),
never through the order the results were given in.

The converted start is the result whose lineage is the uptrained one's up to and including its last
conversion; the parent's lineage is what came before that conversion (for a parent without
mha2gqa.json, an empty lineage and the path the conversion recorded as its source).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mha2gqa.records import provenance
from mha2gqa.runtime.errors import InputError


@dataclass(frozen=True)
class Start:
    """Indexes into the results of an uptrained result's converted start and parent; `missing` says
    in words what was not among the results (None when both were)."""

    converted: int | None
    parent: int | None
    missing: str | None = None


def lineage(result: dict) -> list[dict] | None:
    """The stages of the result's model, oldest first; None when what it recorded is not a lineage (a
    result edited by hand: the report still draws, and says so, instead of refusing the whole table)."""
    record = result["model"].get("provenance")
    if not isinstance(record, dict):
        return []
    try:
        return provenance.lineage_of(record)
    except InputError:
        return None


def _names(result: dict) -> set[str]:
    """The paths a conversion may have recorded for this result's model as its source."""
    model = result["model"]
    names = {str(model.get(key)).rstrip("/") for key in ("path", "resolved") if model.get(key)}
    return names | {str(Path(name).resolve()) for name in names}


def recovery_starts(results: list[dict]) -> list[Start | None]:
    """Per result: None unless it is uptrained; else where its converted start and parent are."""
    stages = [lineage(r) for r in results]
    starts: list[Start | None] = []
    for i, r in enumerate(results):
        if r["role"] != "uptrained":
            starts.append(None)
            continue
        if stages[i] is None:
            starts.append(Start(None, None, "its recorded lineage (model.provenance) is not readable"))
            continue
        kinds = [s["stage"] for s in stages[i]]
        if "conversion" not in kinds:
            starts.append(Start(None, None, "its mha2gqa.json records no conversion"))
            continue
        last = len(kinds) - 1 - kinds[::-1].index("conversion")
        conversion = stages[i][last]
        others = [j for j in range(len(results)) if j != i]
        converted = next((j for j in others if stages[j] == stages[i][: last + 1]), None)
        source = str(conversion.get("source") or "").rstrip("/")
        parent = next(
            (j for j in others if stages[j] == stages[i][:last] and (last > 0 or source in _names(results[j]))),
            None,
        )
        missing = []
        if converted is None:
            missing.append(f"its converted start ({conversion.get('method', '?')}, {conversion.get('groups', '?')} kv)")
        if parent is None:
            missing.append(f"the parent it was converted from ({source or 'unrecorded'})")
        starts.append(Start(converted, parent, " and ".join(missing) + " not among the results" if missing else None))
    return starts
