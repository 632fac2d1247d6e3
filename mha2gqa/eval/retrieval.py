"""The retrieval probe's lines in the terminal (eval --retrieval); the probe itself is scoring/retrieval*.py."""

from __future__ import annotations


def brief_lines(section: dict) -> list[str]:
    """The terminal's lines: recall overall and per length (the reference's beside it), and what was kept."""

    def pair(x: dict) -> str:
        theirs = f" (reference {100 * x['reference_recall']:.0f}%)" if "reference_recall" in x else ""
        return f"{100 * x['recall']:.0f}%{theirs}"

    from mha2gqa.eval.metrics import share

    kept = section.get("answer_probability_kept")
    lines = [
        f"  retrieval recall {pair(section)} over {section['items']} questions"
        + (f", answer probability kept {share(kept)}" if kept is not None else "")
    ]
    return lines + [f"    at {x['length']:,} tokens: {pair(x)}" for x in section["lengths"]]
