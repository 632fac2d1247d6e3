"""`sweep --kv-budgets`: per-layer candidates beside the uniform ones. The layer losses are measured once for
every budget, each budget's row is the conversion `convert --kv-budget` writes (the same counts, the same KV
bytes), it is drawn and recommended beside the uniform candidates, kept by --resume, and a bad budget or parent
is refused before anything is written."""

from __future__ import annotations

import json

import pytest
from fault_helpers import assert_refused, cli, sweep_args
from tiny_models import save_tiny_inputs

import mha2gqa.sweep.budgets as budgets_module
from mha2gqa.architecture.layouts import read_config
from mha2gqa.sweep.trust import trusted

# 4 kv heads in 3 layers; an MLP width the Nemotron-NAS format can state (a multiple of 256)
SHAPE = dict(hidden_size=32, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_inputs(tmp_path_factory.mktemp("sweep-budgets"), **SHAPE)


@pytest.fixture(scope="module")
def swept(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("swept") / "s"
    measured = []
    real = budgets_module.measure_for
    mp = pytest.MonkeyPatch()
    mp.setattr(budgets_module, "measure_for", lambda *a, **k: measured.append(1) or real(*a, **k))
    try:
        result = cli(*sweep_args(tiny, out, "--groups", "2", "--methods", "mean", "--kv-budgets", "0.5,0.75", "--keep"))
    finally:
        mp.undo()
    assert result.exit_code == 0, (result.output, result.exception)
    return out, json.loads((out / "sweep.json").read_text()), measured, result


def test_budget_rows_stand_beside_the_uniform_ones_from_one_loss_measurement(swept):
    out, record, measured, result = swept
    assert measured == [1], "the layer losses are measured once for every budget"
    assert record["planned"] == ["kv2-mean", "budget0.5-mean", "budget0.75-mean"]
    rows = {row["name"]: row for row in record["candidates"]}
    parent_heads = 3 * 4
    for name, share in (("budget0.5-mean", 0.5), ("budget0.75-mean", 0.75)):
        row = rows[name]
        counts = row["kv_heads_per_layer"]
        assert len(counts) == 3 and all(c in (1, 2, 4) for c in counts) and sum(counts) <= share * parent_heads
        assert row["groups"] is None and row["method"] == "per-layer mean" and row["budget"] == str(share)
        # the KV bytes eval measured are the counts' (2 x head_dim 8 x 4 bytes a kv head of a layer)
        assert row["kv_bytes_per_token"] == 2 * 8 * 4 * sum(counts)
        assert row["kv_saving"] == pytest.approx(parent_heads / sum(counts))
        written = json.loads((out / "models" / name / "config.json").read_text())
        if len(set(counts)) == 1:  # a budget that chose one count for every layer is a stock checkpoint
            assert written["model_type"] == "llama" and written["num_key_value_heads"] == counts[0]
        else:
            assert written["model_type"] == "nemotron-nas"
            assert [b["attention"]["n_heads_in_group"] for b in written["block_configs"]] == [4 // c for c in counts]
    md = (out / "sweep.md").read_text()
    assert "| budget0.5-mean |" in md and "per-layer mean" in md
    assert "per-layer mean:" in record["recommendation"]["line"]


def test_resume_keeps_budget_rows_and_doubts_a_changed_count(swept, tiny):
    _, record, _, _ = swept
    context, planned = record["context"], record["planned"]
    assert (
        trusted(record, planned, source_shape(record), context, echo=pytest.fail)["candidates"] == record["candidates"]
    )
    changed = json.loads(json.dumps(record))
    row = next(r for r in changed["candidates"] if r["name"] == "budget0.5-mean")
    row["kv_heads_per_layer"] = [7, 7, 7]
    said = []
    kept = trusted(changed, planned, source_shape(record), context, echo=said.append)["candidates"]
    assert "budget0.5-mean" not in [r["name"] for r in kept] and len(kept) == len(planned) - 1
    assert said and "budget0.5-mean" in said[0] and "kv heads" in said[0]


@pytest.mark.parametrize(
    "budget, fragment",
    [
        ("2", "--kv-budgets 2: 2 bytes per token is less than one kv head per layer"),
        ("1", "--kv-budgets 1: 1 of the parent's KV bytes holds the parent's whole KV cache"),
        ("half", "--kv-budgets 'half': give a fraction of the parent's KV bytes"),
    ],
)
def test_a_budget_the_parent_cannot_meet_is_refused_before_anything_is_written(tiny, tmp_path, budget, fragment):
    out = tmp_path / "out"
    assert_refused(cli(*sweep_args(tiny, out, "--groups", "2", "--kv-budgets", budget)), fragment)
    assert not out.exists()


def test_a_parent_the_format_cannot_hold_is_refused_up_front(tmp_path):
    root = save_tiny_inputs(tmp_path, **dict(SHAPE, intermediate_size=48))  # not a multiple of 256
    assert read_config(root / "src")["intermediate_size"] == 48
    result = cli(*sweep_args(root, root / "out", "--groups", "2", "--kv-budgets", "0.5"))
    assert_refused(result, "256")
    assert not (root / "out").exists()


def source_shape(record: dict):
    """The swept source's attention shape, as sweep --resume checks rows against it."""
    from pathlib import Path

    from mha2gqa.architecture.layouts import attention_shape, read_config

    return attention_shape(read_config(Path(record["source"]["resolved"])))


def _edited(record: dict, row_name: str, **changes) -> dict:
    changed = json.loads(json.dumps(record))
    next(r for r in changed["candidates"] if r["name"] == row_name).update(changes)
    return changed


def test_resume_keeps_and_marks_the_rows_not_asked_again(swept):
    """A resume that asks only for kv2-mean keeps both budget rows (checked, marked), and hands them back when a
    later resume asks for them again."""
    _, record, _, _ = swept
    said = []
    found = trusted(record, ["kv2-mean"], source_shape(record), record["context"], echo=said.append)
    assert [r["name"] for r in found["candidates"]] == ["kv2-mean"]
    assert [r["name"] for r in found["not_asked"]] == ["budget0.5-mean", "budget0.75-mean"]
    assert all(r["asked"] is False for r in found["not_asked"])
    assert said == ["sweep: kept budget0.5-mean, budget0.75-mean from sweep.json, not asked for this time (under not_asked, "
                    "not in the table)"]  # fmt: skip
    again = trusted({**found, "candidates": found["candidates"]}, record["planned"], source_shape(record),
                    record["context"], echo=pytest.fail)  # fmt: skip
    assert again["candidates"] == record["candidates"] and again["not_asked"] == []


def test_resume_with_fewer_budgets_keeps_the_other_rows_in_sweep_json(swept, tiny, tmp_path):
    import shutil

    out = tmp_path / "s"
    shutil.copytree(swept[0], out)
    args = sweep_args(tiny, out, "--groups", "2", "--methods", "mean", "--kv-budgets", "0.5", "--keep", "--resume")
    result = cli(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    written = json.loads((out / "sweep.json").read_text())
    assert [r["name"] for r in written["candidates"]] == ["kv2-mean", "budget0.5-mean"]
    assert [(r["name"], r["asked"]) for r in written["not_asked"]] == [("budget0.75-mean", False)]
    assert "kept budget0.75-mean from sweep.json, not asked for this time" in result.output


def test_a_kept_budget_row_is_checked_against_what_it_claims(swept):
    """Counts over the budget, not one per layer, not divisors, another method: each is run again, with why."""
    _, record, _, _ = swept
    shape, context = source_shape(record), record["context"]
    row = next(r for r in record["candidates"] if r["name"] == "budget0.75-mean")
    counts = row["kv_heads_per_layer"]
    top = max(counts)
    cases = {
        # the same counts under a smaller budget (0.25: 3 kv heads in all); the name follows the budget
        "over its budget's 3": dict(budget="0.25", name="budget0.25-mean"),
        "counts for the source's 3 layers": dict(kv_heads_per_layer=[top, 1]),
        "does not divide 4 kv heads": dict(kv_heads_per_layer=[top, 3, 1] if top == 4 else [top, 3, 3]),
        "is not a budget row's": dict(method="mean"),
    }
    for words, changes in cases.items():
        said = []
        name = changes.get("name", "budget0.75-mean")
        planned = [*record["planned"], name]
        kept = trusted(_edited(record, "budget0.75-mean", **changes), planned, shape, context, echo=said.append)
        assert name not in [r["name"] for r in kept["candidates"]], words
        assert said and words in said[0] and "running it again" in said[0], (words, said)


def test_a_kept_uniform_row_needs_a_method_that_exists(swept):
    _, record, _, _ = swept
    said = []
    changed = _edited(record, "kv2-mean", method="bogus", name="kv2-bogus")
    planned = [*record["planned"], "kv2-bogus"]
    kept = trusted(changed, planned, source_shape(record), record["context"], echo=said.append)
    assert "kv2-bogus" not in [r["name"] for r in kept["candidates"]]
    assert "its method 'bogus' is not one of mha2gqa's" in said[0]


def test_budget_candidates_take_every_method_and_write_what_convert_writes(tiny, tmp_path):
    """--methods mean,calibrated with --kv-budgets 0.5: a budget candidate for each method, the layer losses measured
    once per merge (each layer converted as that candidate merges), each model byte for byte what `convert
    --kv-budget 0.5 --method M` writes from the same calibration text."""
    out = tmp_path / "s"
    args = sweep_args(tiny, out, "--groups", "2", "--methods", "mean,calibrated", "--kv-budgets", "0.5", "--keep")
    measured, real = [], budgets_module.measure_for
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            budgets_module, "measure_for", lambda plan, *a: measured.append(plan.options.method) or real(plan, *a)
        )
        result = cli(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    record = json.loads((out / "sweep.json").read_text())
    assert record["planned"] == ["kv2-mean", "kv2-calibrated", "budget0.5-mean", "budget0.5-calibrated"]
    rows = {row["name"]: row for row in record["candidates"]}
    mean, calibrated = rows["budget0.5-mean"], rows["budget0.5-calibrated"]
    assert (mean["method"], calibrated["method"]) == ("per-layer mean", "per-layer calibrated")
    assert measured == ["mean", "calibrated"]
    assert mean["perplexity"] != calibrated["perplexity"]
    for row in (mean, calibrated):
        dst = tmp_path / row["name"]
        method = row["method"].removeprefix("per-layer ")
        made = cli(
            "convert", tiny / "src", dst, "--kv-budget", "0.5", "--method", method, "--no-refine", "--calibration",
            tiny / "cal.txt", "--calibration-tokens", 600, "--no-check", "--quiet",
        )  # fmt: skip
        assert made.exit_code == 0, made.output
        swept_model = out / "models" / row["name"] / "model.safetensors"
        assert (dst / "model.safetensors").read_bytes() == swept_model.read_bytes(), row["name"]
    md = (out / "sweep.md").read_text()
    assert "per-layer calibrated" in md and "| budget0.5-calibrated |" in md
