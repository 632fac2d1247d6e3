"""What sweep.json's rows say in words, for the table, the plot and the recommendation: a uniform candidate's
kv heads, a --kv-budgets candidate's per-layer ones (sweep/budgets.py), and the methods the rows hold."""

from __future__ import annotations

OWN_COLUMNS = ("label", "role", "kv_heads")  # the sweep's candidate, method and kv heads columns say these
BUDGET_PREFIX = "per-layer "  # a --kv-budgets candidate's method column: 'per-layer calibrated', a line of its own


def budget_method(method: str) -> str:
    """A --kv-budgets candidate's method column: the merge it used, marked per-layer."""
    return BUDGET_PREFIX + method


def merge_method(column: str) -> str | None:
    """The merge method a budget row's method column names ('per-layer mean' -> 'mean'); None for another column."""
    return column.removeprefix(BUDGET_PREFIX) if isinstance(column, str) and column.startswith(BUDGET_PREFIX) else None


def methods_of(record: dict) -> list[str]:
    """The methods of sweep.json's rows, the settings' order, then the per-layer budgets' in the same order."""
    methods = list(record["settings"]["methods"])
    present = {row.get("method") for row in record["candidates"]}
    return methods + [budget_method(m) for m in methods if budget_method(m) in present]


def heads_text(row: dict) -> str:
    """A row's kv heads in words: '2 kv heads', or a budget's '1.5 kv heads a layer (budget 0.5)'."""
    per_layer = row.get("kv_heads_per_layer")
    if per_layer:
        return f"{sum(per_layer) / len(per_layer):.3g} kv heads a layer (budget {row['budget']})"
    return f"{row['groups']} kv head" + ("" if row["groups"] == 1 else "s")
