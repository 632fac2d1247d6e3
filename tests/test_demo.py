"""`mha2gqa demo --quick` end to end on the embedded default, and the ablation grid on a small slice."""

import json

import pytest
from click.testing import CliRunner

from mha2gqa.cli import main
from mha2gqa.demo import markdown_table
from mha2gqa.files.run_folder import MARKER, mark
from mha2gqa.records.provenance import lineage


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--quick"], id="quick"),
        pytest.param([], id="full", marks=pytest.mark.slow),  # ~10 minutes: python -m pytest -m slow
    ],
)
def test_demo_runs_the_whole_job_and_uptraining_recovers(tmp_path, flags):
    result = CliRunner().invoke(main, ["demo", *flags, "--out", str(tmp_path / "demo")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "demo"
    for stage in ("[1/6]", "[2/6]", "[3/6]", "[4/6]", "[5/6]", "[6/6]"):
        assert stage in result.output
    for name in ("report.md", "report.html", "report.json", "quality_vs_kv.png"):
        assert (out / "report" / name).is_file(), name
    results = {
        role: json.loads((out / "results" / f"{role}.json").read_text())
        for role in ("parent", "converted", "uptrained")
    }
    assert [results[r]["role"] for r in results] == ["parent", "converted", "uptrained"]
    ppl = {role: r["perplexity"]["perplexity"] for role, r in results.items()}
    # Pooling 8 distinct kv heads into 2 costs quality, and uptraining wins some of it back.
    assert ppl["parent"] < ppl["uptrained"] < ppl["converted"]
    # convert's check, read off the demo's own evaluation: the verdict of the converted model's ratio
    from mha2gqa.convert.check import verdict

    ratio = ppl["converted"] / ppl["parent"]
    assert f"check: {verdict({'held-out': ratio}).line} (held-out perplexity {ratio:.2f}x" in result.output
    kv = {role: r["kv_cache"]["measured_bytes_per_token"] for role, r in results.items()}
    assert kv["parent"] == 4 * kv["converted"] == 4 * kv["uptrained"]
    stages = lineage(out / "uptrained")  # the embedded model's pretraining, the conversion, the uptraining
    assert [s["stage"] for s in stages] == ["uptrain", "conversion", "uptrain"]
    assert stages[1]["groups"] == 2 and stages[2]["tokens_seen"] > 0
    report = (out / "report" / "report.md").read_text()
    assert "converted (GQA-2)" in report and "uptrained (GQA-2)" in report
    # the offline last-word cloze (lm-eval, installed by [test]) is a column of the report
    assert "persuasion_cloze acc" in report and "Δ acc" in report
    cloze = {role: r["lm_eval"]["tasks"]["persuasion_cloze"] for role, r in results.items()}
    assert all(
        0 <= c["metrics"]["acc"]["value"] <= 1 and c["samples"] == (40 if flags else 355) for c in cloze.values()
    )
    assert "recovery" in result.output
    # the models' cards show the demo's own numbers (its eval beside each model), not only the training check
    for role in ("converted", "uptrained"):
        card = (out / role / "README.md").read_text()
        assert f"| {ppl[role]:.2f} |" in card and "## Evaluation" in card, role
    assert "see the evaluation below" in (out / "converted" / "README.md").read_text()


def _earlier_run(out):
    (out / "report").mkdir(parents=True)
    (out / "report" / "speed_vs_batch.png").write_bytes(b"old plot")
    (out / "results").mkdir()
    (out / "results" / "parent.json").write_text("{}")
    mark(out, "demo")  # every run marks its folder first: a folder of the same names without it is no run


def test_demo_into_an_earlier_run_needs_force_and_changes_nothing(tmp_path):
    out = tmp_path / "demo"
    _earlier_run(out)
    result = CliRunner().invoke(main, ["demo", "--quick", "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: --out {out} holds an earlier demo run: pass --force to replace it, or choose another --out"
    ]
    assert (out / "report" / "speed_vs_batch.png").read_bytes() == b"old plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_demo_never_replaces_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["demo", "--quick", "--force", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "holds files that are not a demo run (notes.txt)" in result.output
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_replaced_run_keeps_no_old_file_and_a_failed_one_restores_it(tmp_path):
    from mha2gqa.demo.pipeline import replacing_run

    out = tmp_path / "demo"
    _earlier_run(out)
    with pytest.raises(KeyboardInterrupt):  # interrupted half way: the earlier run is back, byte for byte
        with replacing_run(out, force=True):
            (out / "report").mkdir()
            (out / "report" / "report.md").write_text("half")
            raise KeyboardInterrupt
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        MARKER,
        "report",
        "report/speed_vs_batch.png",
        "results",
        "results/parent.json",
    ]
    with replacing_run(out, force=True):
        (out / "report").mkdir()
        (out / "report" / "report.md").write_text("new")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [MARKER, "report", "report/report.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # nothing left beside it


def test_reproduce_cli_on_a_slice_writes_table_and_plots(tmp_path):
    out = tmp_path / "ablations"
    result = CliRunner().invoke(
        main,
        [
            "reproduce",
            "--out",
            str(out),
            "--methods",
            "mean,random",
            "--kv-heads",
            "4",
            "--alphas",
            "0,0.005",
            "--eval-blocks",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    table = json.loads((out / "ablations.json").read_text())
    rows = table["rows"]
    parent = [r for r in rows if r["method"].startswith("parent")]
    assert len(parent) == 1 and parent[0]["kv_heads"] == 8
    cells = {(r["method"], r["alpha"]): r["perplexity"] for r in rows if not r["method"].startswith("parent")}
    assert set(cells) == {("mean", 0.0), ("mean", 0.005), ("random", 0.0), ("random", 0.005)}
    # Random K/V destroys what the keys knew; mean-pooling keeps much of it.
    assert parent[0]["perplexity"] < cells[("mean", 0.0)] < cells[("random", 0.0)]
    assert not (out / "work").exists()
    md = (out / "ablations.md").read_text()
    assert md == markdown_table(table) and md in result.output
    assert md.count("\n") == 7 and "| mean | 4 |" in md and "alpha=0.005" in md
    assert all((out / name).stat().st_size > 10_000 for name in ("perplexity_vs_alpha.png", "quality_vs_kv.png"))
    assert f"wrote {out / 'ablations.json'}, {out / 'ablations.md'}" in result.output


def test_reproduce_cli_refuses_a_bad_list_in_one_line(tmp_path):
    result = CliRunner().invoke(main, ["reproduce", "--out", str(tmp_path / "a"), "--alphas", "0,five"])
    assert result.exit_code == 2
    assert result.output.strip() == "Error: --alphas '0,five' must be a comma-separated list of numbers, e.g. 0,0.05"
    assert not (tmp_path / "a").exists()


def test_ablation_kv_bytes_come_from_the_parents_config_and_dtype(tmp_path, monkeypatch):
    import mha2gqa.demo.ablations as ablations

    config = {
        "model_type": "llama",
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "hidden_size": 64,
        "head_dim": 16,
        "dtype": "bfloat16",
        "vocab_size": 100,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    table = {
        "parent": str(tmp_path),
        "eval": "2 blocks",
        "rows": [
            {"method": "parent (MHA)", "kv_heads": 8, "alpha": 0.0, "perplexity": 100.0},
            {"method": "mean", "kv_heads": 4, "alpha": 0.0, "perplexity": 200.0, "alpha_exact": 0.0},
        ],
    }
    seen = {}
    monkeypatch.setattr(ablations, "plot", lambda t, out, **kw: seen.update(kw) or [out / "a.png", out / "b.png"])
    written = ablations.write_ablations(table, tmp_path)
    # K and V, 3 layers, head_dim 16, 2 bytes (bf16): not the fp32 x4 the CLI used to assume
    assert seen == {"kv_bytes_per_head": 2 * 3 * 16 * 2, "dtype": "bfloat16"}
    assert written["markdown"].read_text() == markdown_table(table)
