"""What `sweep --resume` keeps of an earlier sweep.json: only what it can check.

A finished candidate is kept, not run again, when its row is consistent with itself and with its settings:
its name is the one its kv-head count and method give, its method is one that exists, its counts are ones the
source can have (a uniform count divides the source's kv heads; a --kv-budgets row has one count per layer, each a
divisor, summing to no more than its budget allows), its eval result measured that many kv heads, every
number in it is finite, and the columns that follow from its result (per domain, the main metrics, KV bytes)
are what that result and the parent's give again (candidates.derived_columns). The parent is kept when its
entry is what its own result gives (candidates.parent_row) and every number is finite; when it is not, no
candidate is kept, since each was measured against it. Whatever is not kept is run again, and one line says
which and why: a sweep.json edited by hand (a NaN written back as bare `NaN`, a changed kv-head count) can
cost a re-run, never a wrong row. A finished row that this run does not ask for (--groups, --methods or
--kv-budgets changed) is checked alike and kept in sweep.json under `not_asked`, marked, not removed: a later
--resume that asks for it again takes it from there.
"""

from __future__ import annotations

import math

from mha2gqa.architecture.layouts import DTYPE_BYTES, AttentionShape
from mha2gqa.convert.kv_budget import budget_heads
from mha2gqa.convert.options import Method
from mha2gqa.runtime.errors import InputError
from mha2gqa.sweep.candidates import Candidate, derived_columns, parent_row
from mha2gqa.sweep.rows import merge_method

# A result too damaged to derive anything from: a missing key, a string where a number was, a zero divisor.
_DAMAGED = (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError)
# Derived columns a sweep.json written before them lacks: derived again when its row is kept, not doubted.
ADDED_COLUMNS = ("check",)


def trusted(earlier: dict, planned: list[str], shape: AttentionShape, context, echo=print) -> dict:
    """`earlier` (a checked sweep.json) with its parent and candidates reduced to those that hold up (`shape`: the
    source's); each one dropped is said in one line. Rows this run does not plan go to `not_asked`, checked alike
    and marked (asked: false); planned ones come back from there."""
    parent = earlier.get("parent")
    doubt = _parent_doubt(parent, shape.kv_heads, context) if parent is not None else None
    rows = [*(earlier.get("candidates") or []), *(earlier.get("not_asked") or [])]
    if doubt:
        echo(f"sweep: the parent's entry in sweep.json does not hold ({doubt}): measuring it and every candidate again")
        return {**earlier, "parent": None, "candidates": [], "not_asked": []}
    kept, not_asked = [], []
    for row in rows:
        name = row.get("name") if isinstance(row, dict) else None
        asked = name in planned
        doubt = _row_doubt(row, parent, context, shape) if parent is not None else "no parent was measured"
        if doubt:
            again = "running it again" if asked else "not kept (not asked for this time)"
            echo(f"sweep: candidate {name!r} in sweep.json does not hold ({doubt}): {again}")
        elif asked:
            kept.append(
                {key: value for key, value in _with_added_columns(row, parent, context).items() if key != "asked"}
            )
        elif name not in [r["name"] for r in not_asked]:
            not_asked.append({**_with_added_columns(row, parent, context), "asked": False})
    if not_asked:
        names = ", ".join(r["name"] for r in not_asked)
        echo(f"sweep: kept {names} from sweep.json, not asked for this time (under not_asked, not in the table)")
    return {**earlier, "candidates": kept, "not_asked": not_asked}


def _parent_doubt(parent, source_kv_heads: int, context) -> str | None:
    if not isinstance(parent, dict) or not isinstance(parent.get("result"), dict):
        return "it holds no eval result"
    return _entry_doubt(parent, lambda: parent_row(parent["result"], context), source_kv_heads, "the source has")


def _row_doubt(row: dict, parent: dict, context, shape: AttentionShape) -> str | None:
    groups, method, budget = row.get("groups"), row.get("method"), row.get("budget")
    if budget is not None:  # a --kv-budgets row: its largest layer count is what eval records as kv_heads
        per_layer = row.get("kv_heads_per_layer")
        if not isinstance(per_layer, list) or not per_layer or not all(_is_count(c) for c in per_layer):
            return f"its kv_heads_per_layer {per_layer!r} is not a list of kv-head counts"
        doubt = _budget_doubt(per_layer, budget, method, shape)
        if doubt:
            return doubt
        groups, expected, method = None, max(per_layer), merge_method(method)
    elif not _is_count(groups):
        return f"its groups {groups!r} and method {method!r} do not give its name"
    elif method not in [m.value for m in Method]:
        return f"its method {method!r} is not one of mha2gqa's ({', '.join(m.value for m in Method)})"
    elif groups not in shape.valid_groups() or groups >= shape.kv_heads:
        return f"its groups {groups} is not a divisor of the source's {shape.kv_heads} kv heads below it"
    else:
        expected = groups
    if Candidate(groups, method, budget).name != row.get("name"):
        return f"its groups {groups!r} and method {method!r} do not give its name"
    if not isinstance(row.get("result"), dict):
        return "it holds no eval result"
    return _entry_doubt(row, lambda: derived_columns(row["result"], parent["result"], context), expected, "not its")


def _budget_doubt(per_layer: list[int], budget, method, shape: AttentionShape) -> str | None:
    """Why a --kv-budgets row's counts are not ones its budget gives: another method, not one count per layer, a
    count that does not divide the source's kv heads, or more kv heads in all than the budget allows."""
    if merge_method(method) not in [m.value for m in Method]:
        return f"its method {method!r} is not a budget row's ('per-layer' and one of mha2gqa's methods)"
    if len(per_layer) != shape.layers:
        return f"its kv_heads_per_layer has {len(per_layer)} counts for the source's {shape.layers} layers"
    valid = shape.valid_groups()
    if any(count not in valid for count in per_layer):
        return f"its kv_heads_per_layer {per_layer} holds a count that does not divide {shape.kv_heads} kv heads"
    try:
        allowed = budget_heads(str(budget), shape, DTYPE_BYTES[shape.dtype], "its budget")
    except InputError:
        return f"its budget {budget!r} is not one this source can meet"
    if sum(per_layer) > allowed:
        return f"its kv_heads_per_layer {per_layer} sums to {sum(per_layer)} kv heads, over its budget's {allowed}"
    return None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _with_added_columns(row: dict, parent: dict, context) -> dict:
    if all(key in row for key in ADDED_COLUMNS):
        return row
    again = derived_columns(row["result"], parent["result"], context)
    return {**row, **{key: again[key] for key in ADDED_COLUMNS}}


def _entry_doubt(entry: dict, derive, kv_heads: int, expected_words: str) -> str | None:
    """Why an entry holding an eval result does not hold: a non-finite number, a result too damaged to derive its
    columns from (`derive`), a result measured on other than `kv_heads` kv heads, or a column that differs."""
    bad = _non_finite(entry)
    if bad:
        return f"{bad} is not a finite number"
    try:
        again = derive()
        measured = entry["result"]["model"]["kv_heads"]
    except _DAMAGED:
        return "its eval result is incomplete"
    if measured != kv_heads:
        return f"its result measured {measured} kv heads, {expected_words} {kv_heads}"
    return _differs(entry, again)


def _differs(recorded: dict, again: dict) -> str | None:
    """The first column whose recorded value is not what the result gives again."""
    for key, value in again.items():
        if key == "result" or (key in ADDED_COLUMNS and key not in recorded):
            continue
        if recorded.get(key) != value:
            return f"its {key} is not what its eval result gives"
    return None


def _non_finite(value, where: str = "") -> str | None:
    """The dotted path of the first number that is missing its finite value (NaN, inf), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "a value"
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _non_finite(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None
