"""The numbers a model card shows for the `mha2gqa eval` results saved beside its model: the report's measured
metrics (eval/metrics.py METRICS, the entries read from a result's field) that some result there has, with
their headers and formats. card.py lays the card out and sits below eval (convert and uptrain write cards
too), so the commands that write a card beside results (eval, demo) hand it these cells."""

from __future__ import annotations

from pathlib import Path

from mha2gqa.eval import metrics, schema
from mha2gqa.records.card import eval_results

NAMED_BY_THE_CARD = ("label", "role")  # the card's row names the result file instead


def measured_cells(model_dir: Path) -> dict[str, list[tuple[str, str]]]:
    """{result file name: [(column header, cell text)]}, the same columns for every result: the metrics read
    from a field, then the retrieval probe's recall per context length where some result ran it."""
    results = dict(eval_results(Path(model_dir)))
    entries = metrics.entries(list(results.values()))
    listed = [m for m in entries if m.field]
    found = {name: {m.name: schema.field(result, m.field) for m in listed} for name, result in results.items()}
    table = metrics.Table(list(results.values()), 0, None, [None] * len(results))
    per_length = [m for m in entries if m.group == "retrieval"]  # each reads its own result alone
    for i, row in enumerate(found.values()):
        row.update({m.name: m.value(table, [], i) for m in per_length})
    shown = [
        m
        for m in listed + per_length
        if m.column and m.name not in NAMED_BY_THE_CARD and any(row[m.name] is not None for row in found.values())
    ]
    return {name: [(metrics.header(m, None), m.text(row)) for m in shown] for name, row in found.items()}
