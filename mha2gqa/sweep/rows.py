"""What sweep.json's rows say in words, for the table, the plot and the recommendation: a uniform candidate's
kv heads, a --kv-budgets candidate's per-layer ones (sweep/budgets.py), and the methods the rows hold."""

from __future__ import annotations

OWN_COLUMNS = ("label", "role", "kv_heads")  # the sweep's candidate, method and kv heads columns say these
BUDGET_METHOD = "per-layer mean"  # a --kv-budgets candidate's method column: its own line on the plot


def methods_of(record: dict) -> list[str]:
    """The methods of sweep.json's rows, the settings' order, the per-layer budgets' last."""
    budgets = any(row.get("method") == BUDGET_METHOD for row in record["candidates"])
    return list(record["settings"]["methods"]) + ([BUDGET_METHOD] if budgets else [])


def heads_text(row: dict) -> str:
    """A row's kv heads in words: '2 kv heads', or a budget's '1.5 kv heads a layer (budget 0.5)'."""
    per_layer = row.get("kv_heads_per_layer")
    if per_layer:
        return f"{sum(per_layer) / len(per_layer):.3g} kv heads a layer (budget {row['budget']})"
    return f"{row['groups']} kv head" + ("" if row["groups"] == 1 else "s")
