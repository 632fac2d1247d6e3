"""Which tokens a plot's numbers were measured on, as one line for its title.

The demo's training curve ended near 191 held-out perplexity while its table said 158.69: the curve scores
the recipe's first data.eval blocks (16 x 512 tokens) block by block, the table the whole held-out novel in
512-token windows. Both are right; each plot now says which text it measured."""

from __future__ import annotations

from pathlib import Path

from mha2gqa.records import provenance
from mha2gqa.runtime.errors import InputError


def _names(entries) -> str:
    names = [Path(str(e)).name for e in entries or []]
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")


def training_eval(metrics_path: str | Path) -> str:
    """The held-out tokens of an uptrain run's evals, from the recipe in its mha2gqa.json ('' without one)."""
    try:
        stage = provenance.latest(Path(metrics_path).parent, "uptrain")
    except InputError:
        stage = None
    recipe = (stage or {}).get("recipe") or {}
    data, seq_len = recipe.get("data") or {}, recipe.get("seq_len")
    blocks = data.get("eval_blocks")
    if not (blocks and seq_len):
        return ""
    size = f"{blocks} blocks x {seq_len} tokens ({blocks * seq_len:,})"
    if data.get("eval"):
        return f"measured on at most the first {size} of {_names(data['eval'])}, block by block"
    return f"measured on {size} held out of the training text ({_names(data.get('train'))}), block by block"


def perplexity(results: list[dict]) -> str:
    """The tokens the results' perplexities were scored on, when they share one text ('' when none has one)."""
    scored = [r for r in results if r.get("perplexity") and r.get("data")]
    if not scored:
        return ""
    texts = {
        (r["data"].get("ids_sha256"), r["perplexity"].get("context"), r["perplexity"].get("stride")) for r in scored
    }
    if len(texts) > 1:
        return "perplexities measured on different texts or windows: see the report's notes"
    data, ppl = scored[0]["data"], scored[0]["perplexity"]
    where = Path(data["path"]).name if data.get("path") else data.get("name") or data.get("source", "?")
    return (
        f"perplexity on {ppl['tokens_scored']:,} tokens of {where}, "
        f"windows of {ppl['context']} tokens, stride {ppl['stride']}"
    )
