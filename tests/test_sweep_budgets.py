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
from mha2gqa.layouts import read_config
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
    assert record["planned"] == ["kv2-mean", "budget0.5", "budget0.75"]
    rows = {row["name"]: row for row in record["candidates"]}
    parent_heads = 3 * 4
    for name, share in (("budget0.5", 0.5), ("budget0.75", 0.75)):
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
    assert "| budget0.5 |" in md and "per-layer mean" in md
    assert "per-layer mean:" in record["recommendation"]["line"]


def test_resume_keeps_budget_rows_and_doubts_a_changed_count(swept, tiny):
    _, record, _, _ = swept
    context, planned = record["context"], record["planned"]
    assert trusted(record, planned, 4, context, echo=pytest.fail)["candidates"] == record["candidates"]
    changed = json.loads(json.dumps(record))
    row = next(r for r in changed["candidates"] if r["name"] == "budget0.5")
    row["kv_heads_per_layer"] = [7, 7, 7]
    said = []
    kept = trusted(changed, planned, 4, context, echo=said.append)["candidates"]
    assert "budget0.5" not in [r["name"] for r in kept] and len(kept) == len(planned) - 1
    assert said and "budget0.5" in said[0] and "kv heads" in said[0]


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
