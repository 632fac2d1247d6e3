"""`mha2gqa demo --quick` end to end on the embedded default, and the ablation grid on a small slice."""

import json

import pytest
from click.testing import CliRunner

from mha2gqa.cli import main
from mha2gqa.provenance import lineage
from mha2gqa.reproduce import run_grid
from mha2gqa.reproduce_report import markdown_table, plot


@pytest.mark.parametrize("flags", [
    pytest.param(["--quick"], id="quick"),
    pytest.param([], id="full", marks=pytest.mark.slow),  # ~10 minutes: python -m pytest -m slow
])
def test_demo_runs_the_whole_job_and_uptraining_recovers(tmp_path, flags):
    result = CliRunner().invoke(main, ["demo", *flags, "--out", str(tmp_path / "demo")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "demo"
    for stage in ("[1/6]", "[2/6]", "[3/6]", "[4/6]", "[5/6]", "[6/6]"):
        assert stage in result.output
    for name in ("report.md", "report.html", "report.json", "quality_vs_kv.png"):
        assert (out / "report" / name).is_file(), name
    results = {role: json.loads((out / "results" / f"{role}.json").read_text())
               for role in ("parent", "converted", "uptrained")}
    assert [results[r]["role"] for r in results] == ["parent", "converted", "uptrained"]
    ppl = {role: r["perplexity"]["perplexity"] for role, r in results.items()}
    # Pooling 8 distinct kv heads into 2 costs quality, and uptraining wins some of it back.
    assert ppl["parent"] < ppl["uptrained"] < ppl["converted"]
    kv = {role: r["kv_cache"]["measured_bytes_per_token"] for role, r in results.items()}
    assert kv["parent"] == 4 * kv["converted"] == 4 * kv["uptrained"]
    stages = lineage(out / "uptrained")  # the embedded model's pretraining, the conversion, the uptraining
    assert [s["stage"] for s in stages] == ["uptrain", "conversion", "uptrain"]
    assert stages[1]["groups"] == 2 and stages[2]["tokens_seen"] > 0
    report = (out / "report" / "report.md").read_text()
    assert "converted (GQA-2)" in report and "uptrained (GQA-2)" in report
    assert "recovery" in result.output


def test_ablation_grid_on_a_slice_writes_table_and_plots(tmp_path):
    table = run_grid(tmp_path, methods=("mean", "random"), kv_heads=(4,), alphas=(0.0, 0.005), eval_blocks=2,
                     echo=lambda line: None, progress=False)
    rows = table["rows"]
    parent = [r for r in rows if r["method"].startswith("parent")]
    assert len(parent) == 1 and parent[0]["kv_heads"] == 8
    cells = {(r["method"], r["alpha"]): r["perplexity"] for r in rows if not r["method"].startswith("parent")}
    assert set(cells) == {("mean", 0.0), ("mean", 0.005), ("random", 0.0), ("random", 0.005)}
    # Random K/V destroys what the keys knew; mean-pooling keeps much of it.
    assert parent[0]["perplexity"] < cells[("mean", 0.0)] < cells[("random", 0.0)]
    assert not (tmp_path / "work").exists()
    md = markdown_table(table)
    assert md.count("\n") == 7 and "| mean | 4 |" in md and "alpha=0.005" in md
    written = plot(table, tmp_path, kv_bytes_per_head=1024)
    assert all(p.stat().st_size > 10_000 for p in written)
