"""Results side by side: eval measures one model, the report compares many (compare.py), renders them
(render.py, plots.py) and writes report.md/.html/.json (side_by_side.py), reading eval results, sweep.json
(results.py) and serve-bench's files (serving_section.py); a sweep's own pages and plots are here too
(sweep_pages.py, sweep_plots.py). It sits above eval, sweep and serving, whose result formats it reads.

Public entry point (the `mha2gqa report` command calls exactly this):
- `write_report(result_paths, out_dir, baseline=None, metrics=None) -> dict` (see `side_by_side.write_report`)
"""

from __future__ import annotations

__all__ = ["write_report"]


def write_report(result_paths, out_dir, baseline=None, metrics=None, speedup_apart=False, force=False) -> dict:
    """Write report.md, report.html and PNG plots; see `mha2gqa.report.side_by_side.write_report`."""
    # Imported lazily: `import mha2gqa.report` alone must not pay for matplotlib.
    from mha2gqa.report.side_by_side import write_report as _write_report

    return _write_report(
        result_paths, out_dir, baseline=baseline, metrics=metrics, speedup_apart=speedup_apart, force=force
    )
