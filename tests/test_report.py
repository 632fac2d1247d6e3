"""`mha2gqa report`: three result files in, report.md / report.html / report.json / PNGs out."""

import json
import re

import pytest
from click.testing import CliRunner

from mha2gqa.cli import main
from mha2gqa.eval import metrics
from mha2gqa.eval.schema import SCHEMA
from mha2gqa.records import brief
from mha2gqa.report import plots
from mha2gqa.report.side_by_side import write_report
from mha2gqa.runtime.errors import InputError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def stage(kind, **fields):
    """One mha2gqa.json lineage stage; `date` tells two conversions of one parent apart."""
    return {"stage": kind, "version": "0.1.0", **fields}


def lineage_of(*stages):
    return {"schema": "mha2gqa.records.provenance/2", "tool": "mha2gqa", "lineage": list(stages)}


MEAN2 = stage("conversion", source="/m/parent", method="mean", groups=2, date="2026-12-01T10:00:00+00:00")
UPTRAIN = stage("uptrain", source={"model": "/m/gqa2"}, steps=10, date="2026-12-01T11:00:00+00:00")


def fake_result(label, role, kv_heads, ppl, kv_bytes, tps, kl=None, top1=None, data_hash="abc", lineage=()):
    """A schema-valid result with chosen numbers; tps: {batch: tokens/s} at context 128; lineage: the
    stages of the model's mha2gqa.json (none: a model without one)."""
    return {
        "schema": SCHEMA,
        "label": label,
        "role": role,
        "model": {
            "path": f"/m/{label}",
            "model_type": "llama",
            "layers": 2,
            "heads": 8,
            "kv_heads": kv_heads,
            "head_dim": 8,
            "hidden": 64,
            "params": 1000,
            "dtype": "float32",
            "provenance": lineage_of(*lineage) if lineage else None,
        },
        "reference": None,
        "data": {"source": "file", "tokens": 500, "ids_sha256": data_hash},
        "perplexity": {"perplexity": ppl, "tokens_scored": 499, "context": 64, "stride": 32},
        "agreement": None if kl is None else {"kl_mean": kl, "top1_agreement": top1, "tokens": 499},
        "kv_cache": {"formula_bytes_per_token": kv_bytes, "measured_bytes_per_token": kv_bytes, "match": True},
        "speed": {
            "grid": {},
            "points": [
                {
                    "batch": b,
                    "context": 128,
                    "new_tokens": 16,
                    "tokens_per_s": t,
                    "peak_memory_bytes": 2**20,
                    "peak_memory_kind": "cpu_rss",
                }
                for b, t in tps.items()
            ],
        },
        "attention_maps": None,
        "lm_eval": None,
        "warnings": [],
        "env": {"device": "cpu", "device_name": "x86_64", "seed": 0},
    }


@pytest.fixture
def three(tmp_path):
    results = [
        fake_result("parent", "parent", 8, 10.0, 1024, {1: 100.0, 8: 400.0}),
        fake_result("gqa2", "converted", 2, 20.0, 256, {1: 110.0, 8: 1000.0}, kl=0.5, top1=0.6, lineage=[MEAN2]),
        fake_result(
            "gqa2-up", "uptrained", 2, 12.0, 256, {1: 105.0, 8: 1200.0}, kl=0.1, top1=0.9, lineage=[MEAN2, UPTRAIN]
        ),
    ]
    paths = []
    for r in results:
        paths.append(tmp_path / f"{r['label']}.json")
        paths[-1].write_text(json.dumps(r))
    return paths


def test_report_writes_every_output_with_expected_rows_and_numbers(three, tmp_path):
    written = write_report(three, tmp_path / "rep", speedup_apart=True)  # the fakes were timed apart
    assert set(written) == {"markdown", "html", "json", "quality_vs_kv", "speed_vs_batch"}
    for name in ("quality_vs_kv", "speed_vs_batch"):
        assert written[name].read_bytes()[:8] == PNG_MAGIC and written[name].stat().st_size > 10_000

    table = json.loads(written["json"].read_text())
    assert table["baseline"] == "parent" and table["speed_point"] == [8, 128]
    parent, conv, up = table["rows"]
    assert [r["label"] for r in table["rows"]] == ["parent", "gqa2", "gqa2-up"]
    assert conv["perplexity_change"] == pytest.approx(1.0) and up["perplexity_change"] == pytest.approx(0.2)
    assert up["recovery"] == pytest.approx((20 - 12) / (20 - 10))  # 0.8
    assert parent["recovery"] is None and conv["recovery"] is None
    assert conv["kv_saving"] == 4.0 and up["kv_saving"] == 4.0
    assert up["speedup"] == pytest.approx(1200 / 400) and conv["speedup"] == pytest.approx(2.5)
    assert up["speedup_measured"] == "apart" and any(n.startswith("WARNING: the speed-ups of") for n in table["notes"])
    assert (up["kl_mean"], up["top1_agreement"]) == (0.1, 0.9)

    md = written["markdown"].read_text()
    rows = [line for line in md.splitlines() if line.startswith("| gqa2-up |")]
    assert (
        rows[0]
        == "| gqa2-up | uptrained | 2/8 | 12.00 | +20.0% | 80% | 0.1000 | 90.0% | 256 B | 4.00× | 1,200 | 3.00× |"
    )
    assert rows[1].startswith("| gqa2-up | /m/gqa2-up | 1,000 | float32 | 500 tokens")  # provenance
    assert "decode tok/s, median (IQR) @ B=8, T=128 ↑" in md
    assert "![quality_vs_kv](quality_vs_kv.png)" in md

    page = written["html"].read_text()
    assert "<td>80%</td>" in page and "<td>1.0 KiB</td>" in page
    # Self-contained: plots inlined, nothing fetched from elsewhere.
    assert page.count("data:image/png;base64,") == 2
    assert not re.search(r"(src|href)=['\"](?!data:)", page)


# An uptrain metrics.jsonl: an eval before the first step (loss null), a train-only line, train and eval.
METRICS_LINES = "".join(
    json.dumps(m) + "\n"
    for m in [
        {"step": 0, "loss": None, "eval_loss": 3.0, "eval_ppl": 20.0},
        {"step": 10, "loss": 2.8},
        {"step": 20, "loss": 2.5, "eval_loss": 2.6, "eval_ppl": 13.5},
    ]
)


def test_baseline_by_label_and_training_curve(three, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(METRICS_LINES)
    written = write_report(three, tmp_path / "rep", baseline="gqa2", metrics=metrics)
    assert written["training_curve"].read_bytes()[:8] == PNG_MAGIC
    rows = json.loads(written["json"].read_text())["rows"]
    assert rows[0]["kv_saving"] == 0.25 and rows[1]["perplexity_change"] == 0.0
    assert rows[2]["perplexity_change"] == pytest.approx(12 / 20 - 1)


def test_different_data_is_flagged_in_the_notes(three, tmp_path):
    other = json.loads(three[2].read_text())
    other["data"]["ids_sha256"] = "different"
    other["kv_cache"]["match"] = False
    other["warnings"] = ["KV CACHE MISMATCH: test"]
    three[2].write_text(json.dumps(other))
    md = write_report(three, tmp_path / "rep")["markdown"].read_text()
    assert "different token streams" in md
    assert "gqa2-up: KV CACHE MISMATCH: test" in md
    assert "256 B ⚠" in md


def test_bad_inputs_are_refused_before_anything_is_written(three, tmp_path):
    out = tmp_path / "rep"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "something/else"}))
    with pytest.raises(InputError, match="expected 'mha2gqa.eval/1'"):
        write_report([three[0], bad], out)
    with pytest.raises(InputError, match="--baseline 'nope'.*labels: parent, gqa2, gqa2-up"):
        write_report(three, out, baseline="nope")
    with pytest.raises(InputError, match="--metrics .*no such file"):
        write_report(three, out, metrics=tmp_path / "missing.jsonl")
    assert not out.exists()


def test_report_cli(three, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(main, ["report", *map(str, three), "--out", str(tmp_path / "rep")])
    assert ok.exit_code == 0, ok.output
    assert "report.html" in ok.output and (tmp_path / "rep" / "report.md").is_file()
    missing = runner.invoke(main, ["report", str(tmp_path / "nope.json"), "--out", str(tmp_path / "rep2")])
    assert missing.exit_code == 2
    assert "nope.json: no such result file" in missing.output
    assert not (tmp_path / "rep2").exists()


def test_report_into_an_earlier_report_needs_force(three, tmp_path):
    """A second report into the same --out is refused in one line and changes nothing; --force replaces it."""
    out = tmp_path / "rep"
    runner = CliRunner()
    assert runner.invoke(main, ["report", *map(str, three), "--out", str(out), "--speedup-apart"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = runner.invoke(main, ["report", *map(str, three), "--out", str(out), "--baseline", "gqa2"])
    assert again.exit_code == 2, again.output
    assert again.output.strip().splitlines() == [
        f"Error: --out {out} holds an earlier report (quality_vs_kv.png, report.html, report.json, report.md, "
        "speed_vs_batch.png): pass --force to replace it, or choose another --out"
    ]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    forced = runner.invoke(main, ["report", *map(str, three), "--out", str(out), "--baseline", "gqa2", "--force"])
    assert forced.exit_code == 0, forced.output
    assert json.loads((out / "report.json").read_text())["baseline"] == "gqa2"


def write_results(tmp_path, results):
    paths = []
    for r in results:
        paths.append(tmp_path / f"{r['label']}.json")
        paths[-1].write_text(json.dumps(r))
    return paths


CALIBRATED2 = stage("conversion", source="/m/parent", method="calibrated", groups=2, date="2026-12-01T09:00:00+00:00")


def test_recovery_pairs_each_uptrained_model_with_its_own_start_whatever_the_order(tmp_path):
    # The order: `report parent.json calibrated-2.json mean-2.json austen-up.json`, austen-up
    # uptrained from mean-2. Paired by order it was measured against calibrated-2: (11 - 15) / (11 - 10).
    results = [
        fake_result("parent", "parent", 8, 10.0, 1024, {8: 400.0}),
        fake_result("calibrated-2", "converted", 2, 11.0, 256, {8: 1000.0}, lineage=[CALIBRATED2]),
        fake_result("mean-2", "converted", 2, 30.0, 256, {8: 1000.0}, lineage=[MEAN2]),
        fake_result("austen-up", "uptrained", 2, 15.0, 256, {8: 1000.0}, lineage=[MEAN2, UPTRAIN]),
    ]
    paths = write_results(tmp_path, results)
    written = write_report(paths, tmp_path / "rep")
    rows = json.loads(written["json"].read_text())["rows"]
    assert rows[3]["recovery"] == pytest.approx((30 - 15) / (30 - 10)) and rows[3]["recovery_from"] == "mean-2"
    assert "| austen-up | uptrained | 2/8 | 15.00 | +50.0% | 75% |" in written["markdown"].read_text()

    # Without its converted start the recovery is not given, and the notes say why.
    written = write_report([paths[0], paths[1], paths[3]], tmp_path / "rep2")
    table = json.loads(written["json"].read_text())
    assert table["rows"][2]["recovery"] is None and table["rows"][2]["recovery_from"] is None
    assert (
        "recovery of austen-up: not given, its converted start (mean, 2 kv) not among the results "
        "(pass the result files of the models it was converted from and uptrained from)"
    ) in table["notes"]
    assert "| austen-up | uptrained | 2/8 | 15.00 | +50.0% | — |" in written["markdown"].read_text()


def test_recovery_without_a_parent_or_a_conversion_says_so(tmp_path):
    results = [
        fake_result("mean-2", "converted", 2, 30.0, 256, {8: 1000.0}, lineage=[MEAN2]),
        fake_result("austen-up", "uptrained", 2, 15.0, 256, {8: 1000.0}, lineage=[MEAN2, UPTRAIN]),
        fake_result("by-flag", "uptrained", 2, 15.0, 256, {8: 1000.0}),  # --role uptrained, no mha2gqa.json
        fake_result("edited", "uptrained", 2, 15.0, 256, {8: 1000.0}),
    ]
    results[3]["model"]["provenance"] = {"lineage": "not a list"}
    notes = json.loads(write_report(write_results(tmp_path, results), tmp_path / "rep")["json"].read_text())["notes"]
    assert any(
        "recovery of austen-up: not given, the parent it was converted from (/m/parent) not among" in n for n in notes
    )
    assert any("recovery of by-flag: not given, its mha2gqa.json records no conversion" in n for n in notes)
    assert any(
        "recovery of edited: not given, its recorded lineage (model.provenance) is not readable" in n for n in notes
    )


def with_repeats(result, decode_s, batch=4, new_tokens=16):
    """The result's one speed point as eval wrote it before the spread was stored: only the repeats."""
    median = sorted(decode_s)[len(decode_s) // 2]
    result["speed"]["points"] = [
        {
            "batch": batch,
            "context": 32,
            "new_tokens": new_tokens,
            "tokens_per_s": batch * new_tokens / median,
            "decode_s_median": median,
            "decode_s": decode_s,
            "peak_memory_bytes": 2**20,
            "peak_memory_kind": "cpu_rss",
        }
    ]
    return result


def test_a_speed_up_inside_the_noise_is_marked_not_claimed(tmp_path):
    results = [
        with_repeats(fake_result("parent", "parent", 8, 10.0, 1024, {}), [0.10, 0.11, 0.12, 0.50, 1.78]),
        with_repeats(fake_result("noisy", "converted", 2, 20.0, 256, {}), [0.05, 0.09, 0.10, 0.20, 0.30]),
        with_repeats(fake_result("clear", "converted", 2, 20.0, 256, {}), [0.020, 0.021, 0.022, 0.023, 0.024]),
    ]
    written = write_report(write_results(tmp_path, results), tmp_path / "rep", speedup_apart=True)
    table = json.loads(written["json"].read_text())
    parent, noisy, clear = table["rows"]
    # The interquartile ranges of tokens/s (64 tokens a run), from the repeats' decode seconds.
    assert parent["tokens_per_s_iqr"] == pytest.approx([64 / 0.50, 64 / 0.11])
    assert noisy["tokens_per_s_iqr"] == pytest.approx([64 / 0.20, 64 / 0.09])
    assert noisy["speedup"] == pytest.approx(0.12 / 0.10)
    # Five repeats: each median's ~95% interval is its whole min-max range (order statistics).
    assert noisy["tokens_per_s_interval"] == pytest.approx([64 / 0.30, 64 / 0.05])
    assert noisy["speedup_range"] == pytest.approx([(64 / 0.30) / (64 / 0.10), (64 / 0.05) / (64 / 1.78)])
    assert noisy["speedup_noisy"] is True and clear["speedup_noisy"] is False and parent["speedup_noisy"] is None
    md = written["markdown"].read_text()
    noisy_row = next(line for line in md.splitlines() if line.startswith("| noisy |"))
    clear_row = next(line for line in md.splitlines() if line.startswith("| clear |"))
    assert noisy_row.endswith("| 640 (320–711) | noise (0.33–35.60×) |")
    assert clear_row.endswith(f"| 2,909 (2,783–3,048) | {0.12 / 0.022:.2f}× |")
    assert any("marked noise is smaller than its uncertainty" in n for n in table["notes"])

    # The plot draws what the table says: the speed-ups with their ranges, the noisy one hollow and labelled.
    fig = plots.speed_figure(results, speedup_apart=True)
    ax = fig.axes[0]
    drawn = {
        round(float(line.get_ydata()[0]), 6): line.get_markerfacecolor()
        for line in ax.get_lines()
        if len(line.get_ydata()) == 1 and line.get_marker() == "o"
    }
    assert sorted(drawn) == pytest.approx(sorted([0.12 / 0.10, 0.12 / 0.022]))
    noisy_face = drawn[round(0.12 / 0.10, 6)]
    assert noisy_face == "white" and drawn[round(0.12 / 0.022, 6)] != "white"
    assert [t.get_text() for t in ax.texts] == ["noise"]
    assert plots.speed_figure(results) is None  # timed apart, without --speedup-apart: nothing to set side by side


def test_columns_nobody_measured_are_left_out_and_lm_eval_gets_its_own_table(three, tmp_path):
    results = [json.loads(p.read_text()) for p in three]
    for r in results:
        r["speed"] = None  # as `demo --quick` and `eval --speed off` write them
    results[0]["lm_eval"] = {
        "tasks": {
            "persuasion_cloze": {
                "samples": 40,
                "metrics": {
                    "perplexity": {
                        "value": 8081.2,
                        "stderr": 57586.4,
                        "higher_is_better": False,
                        "interval_95": [585.39, 111559.0],
                    },
                    "acc": {"value": 0.075, "stderr": 0.042, "higher_is_better": True},
                },
            }
        }
    }
    results[1]["lm_eval"] = {
        "tasks": {
            "persuasion_cloze": {"samples": 40, "metrics": {"perplexity": {"value": 21702.1, "stderr": 123251.8}}}
        }
    }
    written = write_report(write_results(tmp_path, results), tmp_path / "rep")
    md = written["markdown"].read_text()
    main, lm_eval = [line for line in md.splitlines() if line.startswith("| model |")][:2]
    assert "decode" not in main and "speed-up" not in main and "persuasion" not in main
    assert lm_eval == "| model | persuasion_cloze perplexity ↓ | Δ perplexity ↓ | persuasion_cloze acc ↑ | Δ acc ↑ |"
    assert "| parent | 8,081 (585–111,559) | +0.0% | 7.5% ± 4.2 | +0.0 pt |" in md  # an interval, not ± 57,586
    assert "| gqa2 | 21,702 | +168.6% | — | — |" in md  # written before intervals were kept: the value alone
    assert "- Left out, no result has a value: decode tok/s, median (IQR), decode path, speed-up." in md
    page = written["html"].read_text()
    assert page.count("<table>") == 2 and "<h2>lm-evaluation-harness tasks</h2>" in page


def test_a_new_metric_is_one_registry_entry(three, tmp_path, monkeypatch):
    scored = metrics.Metric(
        "tokens_scored",
        "tokens scored",
        "tokens whose loss entered the perplexity",
        "perplexity.tokens_scored",
        fmt=str,
    )
    monkeypatch.setattr(metrics, "METRICS", [*metrics.METRICS, scored])
    written = write_report(three, tmp_path / "rep", speedup_apart=True)
    table = json.loads(written["json"].read_text())
    assert [row["tokens_scored"] for row in table["rows"]] == [499, 499, 499]
    assert scored.legend() in table["metrics"]
    md = written["markdown"].read_text()
    assert next(line for line in md.splitlines() if line.startswith("| model |")).endswith(
        "| speed-up ↑ | tokens scored |"
    )
    assert next(line for line in md.splitlines() if line.startswith("| gqa2 |")).endswith("| 2.50× | 499 |")


def test_training_curve_keeps_the_train_objective_apart_from_the_held_out_loss(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(METRICS_LINES)
    assert plots.training_objective(run / "metrics.jsonl").startswith("train loss (LM loss, mixed with KL")
    distill = {"teacher": "/m/parent", "kl_weight": 0.25, "temperature": 2.0}
    (run / "mha2gqa.json").write_text(json.dumps(lineage_of(MEAN2, stage("uptrain", recipe={"distill": distill}))))
    fig = plots.training_figure(run / "metrics.jsonl")
    train, held_out = fig.axes
    assert [t.get_text() for t in train.get_legend().get_texts()] == [
        "train objective: 0.75·LM + 0.25·T²·KL(teacher‖model), T=2"
    ]
    assert [t.get_text() for t in held_out.get_legend().get_texts()] == ["held-out LM perplexity"]
    assert held_out.get_ylabel() == "LM perplexity" and train.get_ylabel() == "nats/token"
    assert list(held_out.get_lines()[0].get_ydata()) == [20.0, 13.5]


def test_lm_eval_in_a_line_gives_perplexity_an_interval_not_a_bootstrapped_plus_minus():
    cloze = {"value": 8081.2, "stderr": 57586.4, "higher_is_better": False}
    assert brief.lm_eval_brief("perplexity", {**cloze, "interval_95": [3012.0, 21684.0]}) == "8081 (95% 3012-2.168e+04)"
    assert brief.lm_eval_brief("perplexity", cloze) == "8081"
    assert brief.lm_eval_brief("acc", {"value": 0.075, "stderr": 0.042}) == "0.075 ± 0.042"


def test_training_panels_share_the_step_axis(tmp_path):
    metrics_file = tmp_path / "metrics.jsonl"  # the demo --quick run: one train line, evals at 0 and 3
    metrics_file.write_text(
        json.dumps({"step": 0, "loss": None, "eval_loss": 5.88, "eval_ppl": 358.7})
        + "\n"
        + json.dumps({"step": 3, "loss": 5.39, "eval_loss": 5.66, "eval_ppl": 287.7})
        + "\n"
    )
    train, held_out = plots.training_figure(metrics_file).axes
    assert train.get_xlim() == held_out.get_xlim() and train.get_xlim()[0] < 0 < 3 < train.get_xlim()[1]


def test_the_median_interval_is_min_max_for_few_repeats_and_narrows_with_more():
    assert metrics.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)
    thirty = [float(v) for v in range(30)]
    assert metrics.median_interval(thirty) == (9.0, 20.0)  # n/2 -+ 0.98 sqrt(n), inside the IQR (7.25, 21.75)
