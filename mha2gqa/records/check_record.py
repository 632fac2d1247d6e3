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


def retrieval_line(record: dict) -> str | None:
    """--check-retrieval's line: recall overall and per context length, SRC's beside it; None without the probe."""
    found = record.get("retrieval")
    if not found:
        return None

    def pair(x: dict) -> str:
        return f"{100 * x['recall']:.0f}% (SRC {100 * x['reference_recall']:.0f}%)"

    lengths = ", ".join(f"{x['length']:,} tokens {pair(x)}" for x in found["lengths"])
    return (
        f"retrieval probe: recall {pair(found)} over {found['items']} questions; by context length {lengths}; "
        f"SRC's answer probability kept {found['answer_probability_kept']:.3g}"
    )


def _number(value, spec: str, unit: str = "") -> str:
    return "not finite" if value is None else f"{value:{spec}}{unit}"


def title(record: dict) -> str:
    cached = "; SRC's numbers from the cache" if record.get("parent_cached") else ""
    return (
        f"check: what DST kept, on the first {record['tokens_per_domain']} tokens of each probe domain "
        f"(KL over SRC's top {record['top_k']} tokens{cached})"
    )
