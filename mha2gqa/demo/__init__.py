"""The embedded default, end to end: everything `mha2gqa demo` and `mha2gqa reproduce` produce.

pipeline.py   plan_demo (every check, torch-free) -> run_demo: inspect -> convert -> eval -> uptrain (demo-uptrain.yaml) -> eval -> report
ablations.py  plan_reproduce (every check, torch-free) -> reproduce = run_grid (the GQA paper's method x kv heads x alpha grid) + write_ablations (table, plots)

The CLI only parses flags and calls these. The model and corpus live in mha2gqa/data (mha2gqa.files.embedded).
"""

from mha2gqa.demo.ablations import markdown_table, plan_reproduce, plot, reproduce, run_grid, write_ablations
from mha2gqa.demo.pipeline import (
    DEMO_RECIPE,
    DemoSettings,
    embedded_run_overrides,
    plan_demo,
    run_demo,
    summary_rows,
)

__all__ = [
    "DEMO_RECIPE",
    "DemoSettings",
    "embedded_run_overrides",
    "markdown_table",
    "plan_demo",
    "plan_reproduce",
    "plot",
    "reproduce",
    "run_demo",
    "run_grid",
    "summary_rows",
    "write_ablations",
]
