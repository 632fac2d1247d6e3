"""Measure a model: perplexity, agreement with a reference, KV-cache bytes, decode speed; and compare
many measured models in one report.

Public entry points (the `mha2gqa eval` / `mha2gqa report` commands call exactly these):
- `evaluate(model_path, data=..., reference=None, ..., out=None) -> dict` (see `mha2gqa.eval.run`)
- `mha2gqa.eval.report.write_report(result_paths, out_dir, baseline=None, metrics=None) -> dict`
"""

from __future__ import annotations

__all__ = ["evaluate", "write_report"]


def evaluate(model_path, *args, **kwargs) -> dict:
    """Evaluate one model and return (and optionally write) its result dict; see `run.evaluate`."""
    # Imported lazily: `mha2gqa.eval.report` alone must not pay for torch/transformers.
    from mha2gqa.eval.run import evaluate as _evaluate

    return _evaluate(model_path, *args, **kwargs)


def write_report(result_paths, out_dir, baseline=None, metrics=None, speedup_apart=False, force=False) -> dict:
    """Write report.md, report.html and PNG plots; see `mha2gqa.eval.report.write_report`."""
    from mha2gqa.eval.report import write_report as _write_report

    return _write_report(
        result_paths, out_dir, baseline=baseline, metrics=metrics, speedup_apart=speedup_apart, force=force
    )
