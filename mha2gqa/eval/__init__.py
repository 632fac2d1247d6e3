"""Measure one model: perplexity, agreement with a reference, KV-cache bytes, decode speed (comparing many
measured models is the report's: mha2gqa/report/).

Public entry point (the `mha2gqa eval` command calls exactly this):
- `evaluate(model_path, data=..., reference=None, ..., out=None) -> dict` (see `mha2gqa.eval.run`)
"""

from __future__ import annotations

__all__ = ["evaluate"]


def evaluate(model_path, *args, **kwargs) -> dict:
    """Evaluate one model and return (and optionally write) its result dict; see `run.evaluate`."""
    # Imported lazily: `mha2gqa.eval.schema` alone must not pay for torch/transformers.
    from mha2gqa.eval.run import evaluate as _evaluate

    return _evaluate(model_path, *args, **kwargs)
