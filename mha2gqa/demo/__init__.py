"""The embedded default, end to end: everything `mha2gqa demo` and `mha2gqa reproduce` produce.

pipeline.py   run_demo: inspect -> convert -> eval -> uptrain (demo-uptrain.yaml) -> eval -> report
ablations.py  reproduce = run_grid (the GQA paper's method x kv heads x alpha grid) + write_ablations (table, plots)

The CLI only parses flags and calls these. The model and corpus live in mha2gqa/data (mha2gqa.embedded).
"""

from mha2gqa.demo.ablations import markdown_table, plot, reproduce, run_grid, write_ablations
from mha2gqa.demo.pipeline import DEMO_RECIPE, DemoSettings, embedded_run_overrides, run_demo, summary_rows

__all__ = [
    "DEMO_RECIPE",
    "DemoSettings",
    "embedded_run_overrides",
    "markdown_table",
    "plot",
    "reproduce",
    "run_demo",
    "run_grid",
    "summary_rows",
    "write_ablations",
]
