"""`mha2gqa sweep`: every kv-head count x method converted with one calibration pass and evaluated against
the parent, so the choice of target is made before any training (run.py; its record's format: schema.py; the pages: report/sweep_pages.py)."""

from __future__ import annotations

__all__ = ["SweepOptions", "sweep"]

from mha2gqa.sweep.options import SweepOptions


def sweep(src, options: SweepOptions, echo=print, pages=None) -> dict:
    """Run a sweep; see `mha2gqa.sweep.run.sweep`. Imported lazily: the options need no torch."""
    from mha2gqa.sweep.run import sweep as _sweep

    return _sweep(src, options, echo, pages)
