"""A one-result report compares the result with its own reference, or says plainly there is nothing to
compare with; it never shows a model as its own baseline (issue 36: `report` of SmolLM2's MQA result printed
"Baseline: mean", 1.00x on every domain and a KV saving of 1.00x, although the file held the parent's 1,141x)."""

from __future__ import annotations

import copy
import json

import pytest
from test_report import MEAN2, fake_result

from mha2gqa.eval.reference_result import reference_of
from mha2gqa.report.side_by_side import write_report


def with_domains(result: dict, mine: dict, theirs: dict | None) -> dict:
    """`result` measured on domains {name: perplexity}, against a reference with perplexities `theirs`."""
    result = copy.deepcopy(result)
    result["domains"] = {
        name: {
            "data": {"source": "file", "tokens": 100, "ids_sha256": f"ids-{name}"},
            "perplexity": {"perplexity": ppl, "tokens_scored": 99, "context": 64, "stride": 64, "windows": 2},
            "agreement": None
            if theirs is None
            else {"kl_mean": 0.5, "top1_agreement": 0.6, "tokens": 99, "reference_perplexity": theirs[name]},
        }
        for name, ppl in mine.items()
    }
    if theirs is not None:
        result["agreement"]["reference_perplexity"] = 10.0
    return result


@pytest.fixture
def mqa(tmp_path):
    """A converted model's result against its parent (8 -> 2 kv heads), the parent timed side by side."""
    conversion = {**MEAN2, "source_kv_heads": 8}
    result = fake_result(
        "mean", "converted", 2, 40.0, 256, {1: 110.0, 8: 1000.0}, kl=0.5, top1=0.6, lineage=[conversion]
    )
    result = with_domains(result, {"prose": 40.0, "code": 90.0}, {"prose": 20.0, "code": 30.0})
    result["reference"] = {"path": "/m/parent", "resolved": "/m/parent", "label": "parent"}
    parent_points = copy.deepcopy(result["speed"]["points"])
    for p in parent_points:
        p["tokens_per_s"] /= 2
    result["speed"]["side_by_side"] = {
        "id": "run-1",
        "points": parent_points,
        "reference_label": "parent",
        "reference_resolved": "/m/parent",
    }
    return result


def _report(tmp_path, result: dict) -> tuple[dict, str]:
    path = tmp_path / "one.json"
    path.write_text(json.dumps(result))
    written = write_report([path], tmp_path / "rep")
    return json.loads(written["json"].read_text()), written["markdown"].read_text()


def test_one_result_is_compared_with_its_own_reference(tmp_path, mqa):
    table, md = _report(tmp_path, mqa)
    assert table["baseline"] == "parent (reference)"
    parent, mine = table["rows"]
    assert [parent["label"], mine["label"]] == ["parent (reference)", "mean"]
    assert parent["perplexity"] == 10.0 and mine["perplexity_change"] == pytest.approx(3.0)  # 40 / 10 - 1
    assert mine["domains_ratio"] == pytest.approx((2.0 * 3.0) ** 0.5)  # prose 40/20, code 90/30
    assert mine["domain:code:perplexity"] == {"perplexity": 90.0, "ratio": pytest.approx(3.0)}
    # 8 kv heads (the conversion record's source) against 2: by formula, 4x
    assert parent["kv_bytes_per_token"] == 1024 and mine["kv_saving"] == 4.0
    assert mine["speedup"] == pytest.approx(2.0) and mine["speedup_measured"] == "side by side"
    assert "Baseline: **parent (reference)**, from mean's result file" in md
    assert "| mean | 40.00 (2.00×) | 0.5000 | 60.0% | 90.00 (3.00×) |" in md  # not 1.00x: against the parent


def test_the_reference_shape_eval_records_is_used(tmp_path, mqa):
    mqa["model"]["provenance"] = None  # no lineage: the shape comes from the reference section alone
    mqa["reference"].update(kv_heads=8, heads=8, layers=2, head_dim=8, params=1200, dtype="float32")
    mqa["reference"]["kv_formula_bytes_per_token"] = 1024
    parent = reference_of(mqa)
    assert parent["model"]["kv_heads"] == 8 and parent["model"]["params"] == 1200
    assert parent["kv_cache"]["formula_bytes_per_token"] == 1024 and parent["role"] == "parent"
    assert reference_of({**mqa, "reference": None}) is None


def test_one_result_without_a_reference_says_there_is_nothing_to_compare(tmp_path):
    alone = fake_result("parent", "parent", 8, 10.0, 1024, {1: 100.0, 8: 400.0})
    alone = with_domains(alone, {"prose": 20.0, "code": 30.0}, None)
    table, md = _report(tmp_path, alone)
    (row,) = table["rows"]
    assert table["baseline"] is None
    assert row["perplexity"] == 10.0 and row["perplexity_change"] is None and row["kv_saving"] is None
    assert row["domain:prose:perplexity"] == {"perplexity": 20.0, "ratio": None}
    assert "Nothing to compare with" in md and "Baseline:" not in md
    assert "1.00×" not in md and "+0.0%" not in md
