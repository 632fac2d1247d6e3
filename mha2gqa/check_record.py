"""The record of `convert`'s quality check (convert/check.py writes it into mha2gqa.json) as the terminal and
the model card show it: one table row a probe domain. Below convert/ and card.py, so both read it."""

from __future__ import annotations

HEADERS = ["domain", "SRC perplexity", "DST perplexity", "ratio", "KL", "top-1"]


def table_rows(record: dict) -> list[list[str]]:
    """The check's table, a row a domain (HEADERS), for the terminal and the card."""
    return [
        [
            name,
            _number(row["parent_perplexity"], ".2f"),
            _number(row["perplexity"], ".2f"),
            _number(row["ratio"], ".3g", "x"),
            _number(row.get("kl_mean", row.get("kl")), ".3f"),  # kl, top1: the names before eval's (2026-12-06)
            _number(row.get("top1_agreement", row.get("top1")), ".3f"),
        ]
        for name, row in record["domains"].items()
    ]


def _number(value, spec: str, unit: str = "") -> str:
    return "not finite" if value is None else f"{value:{spec}}{unit}"


def title(record: dict) -> str:
    cached = "; SRC's numbers from the cache" if record.get("parent_cached") else ""
    return (
        f"check: what DST kept, on the first {record['tokens_per_domain']} tokens of each probe domain "
        f"(KL over SRC's top {record['top_k']} tokens{cached})"
    )
