"""A speed-up only from models timed side by side: eval records the machine's load beside every speed and can
time the reference in turn with the model; report computes no speed-up from separate runs unless asked
(and then warns); a speed median outside its own IQR is drawn without its bar, not a matplotlib crash."""

import json

import pytest
from test_report import fake_result, write_results
from tiny_models import SAMPLE_TEXT, save_tiny_family

from mha2gqa.eval import evaluate, speed
from mha2gqa.eval.measurements import validate_all
from mha2gqa.eval.options import EvalOptions
from mha2gqa.report import plots, write_report
from mha2gqa.runtime.errors import InputError

FAST = dict(speed_preset="cpu", speed_batches=(1,), speed_contexts=(8,), new_tokens=2, repeats=3, progress=False)


def with_load(result: dict, load: float, cpus: int = 2) -> dict:
    for p in result["speed"]["points"]:
        p.update(load_average=[load, load, load], cpu_count=cpus)
    return result


def test_speeds_from_separate_runs_give_no_speed_up_and_say_why(tmp_path):
    """The issue's full demo: three models timed 20-40 minutes apart, at load 4, 13 and 8."""
    results = [
        with_load(fake_result("parent", "parent", 8, 10.0, 1024, {4: 82.0}), 4.0),
        with_load(fake_result("converted", "converted", 2, 20.0, 256, {4: 23.9}), 13.0),
        with_load(fake_result("uptrained", "uptrained", 2, 12.0, 256, {4: 60.6}), 8.0),
    ]
    written = write_report(write_results(tmp_path, results), tmp_path / "rep")
    table = json.loads(written["json"].read_text())
    assert [r["speedup"] for r in table["rows"]] == [None, None, None]
    (note,) = [n for n in table["notes"] if n.startswith("No speed-up for")]
    assert "converted, uptrained" in note and "not side by side" in note
    for label, load in (("parent", 4.0), ("converted", 13.0), ("uptrained", 8.0)):
        assert f"{label} at load {load:.1f} on 2 CPUs" in note
    md = written["markdown"].read_text()
    assert "speed-up ↑" not in md and "0.29×" not in md
    assert "| 23.9, load 13.0/2 CPUs |" in md  # each speed shown beside its machine's load
    assert "speed_vs_batch" not in written  # nor drawn: three loads side by side are no comparison of models

    asked = json.loads(
        write_report(write_results(tmp_path, results), tmp_path / "asked", speedup_apart=True)["json"].read_text()
    )
    assert asked["rows"][1]["speedup"] == pytest.approx(23.9 / 82.0) and asked["rows"][1]["speedup_measured"] == "apart"
    assert any(
        n.startswith("WARNING: the speed-ups of converted, uptrained divide speeds timed apart") for n in asked["notes"]
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = save_tiny_family(tmp_path_factory.mktemp("speed"), {"parent": 4, "gqa": 1})
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def test_eval_times_the_reference_side_by_side_and_the_report_divides_those(tiny, tmp_path):
    gqa = evaluate(
        tiny / "gqa", str(tiny / "text.txt"), reference=tiny / "parent", context=32, out=tmp_path / "gqa.json",
        speed_side_by_side=True, **FAST,
    )  # fmt: skip
    parent = evaluate(tiny / "parent", str(tiny / "text.txt"), context=32, out=tmp_path / "parent.json", **FAST)
    together = gqa["speed"]["side_by_side"]
    assert together["reference_resolved"] == parent["model"]["resolved"] and len(together["id"]) == 32
    for p in [*gqa["speed"]["points"], *together["points"], *parent["speed"]["points"]]:
        assert len(p["load_average"]) == 3 and p["cpu_count"] >= 1 and p["cpus_usable"] >= 1
    (mine,), (theirs,) = gqa["speed"]["points"], together["points"]
    assert mine["repeats"] == theirs["repeats"]  # in turn: one of each per round
    table = json.loads(
        write_report([tmp_path / "parent.json", tmp_path / "gqa.json"], tmp_path / "rep")["json"].read_text()
    )
    row = table["rows"][1]
    assert row["speedup_measured"] == "side by side"
    # the speed-up divides the two speeds timed together, not the parent's own run
    assert row["speedup"] == pytest.approx(mine["tokens_per_s"] / theirs["tokens_per_s"])
    assert table["rows"][0]["speedup"] == 1.0 and not any(n.startswith("No speed-up") for n in table["notes"])


def test_side_by_side_alternates_the_models_repeat_by_repeat(tiny, monkeypatch):
    from mha2gqa.eval.model import load_model, pick_device

    models = [load_model(tiny / name, "auto", pick_device("cpu"), False) for name in ("gqa", "parent")]
    order = []
    real = speed.greedy_decode

    def recorded(model, ids, new_tokens, *path):
        order.append(models.index(model))
        return real(model, ids, new_tokens, *path)

    monkeypatch.setattr(speed, "greedy_decode", recorded)
    grid = speed.SpeedGrid(batches=(1,), contexts=(8,), new_tokens=2, repeats=3, seconds=0.0)
    mine, theirs = speed.measure_side_by_side(models, 1, 8, grid)
    assert order == [0, 1, 0, 1, 0, 1, 0, 1]  # a warm-up each, then three rounds of A, B
    assert mine["repeats"] == theirs["repeats"] == 3 and "2 models side by side" in mine["peak_memory_kind"]


def test_side_by_side_needs_a_reference_and_speed():
    with pytest.raises(InputError, match="--speed-side-by-side needs --reference"):
        validate_all(EvalOptions(speed_side_by_side=True))
    with pytest.raises(InputError, match="drop --speed off"):
        validate_all(EvalOptions(speed_side_by_side=True, reference="p", speed_preset="off"))


def test_a_median_outside_its_own_iqr_is_drawn_without_its_bar(tmp_path):
    """Issue 29 class 10: matplotlib refused the whole report ("'yerr' must not contain negative values"). A lone
    result's plot draws its tokens/s with their IQR bars."""
    odd = fake_result("odd", "converted", 2, 20.0, 256, {1: 50.0, 4: 90.0})
    odd["speed"]["points"][1]["tokens_per_s_iqr"] = [100.0, 120.0]  # the median 90 lies below its IQR
    results = [odd]
    written = write_report(write_results(tmp_path, results), tmp_path / "rep")
    assert written["speed_vs_batch"].read_bytes()[:4] == b"\x89PNG"
    notes = json.loads(written["json"].read_text())["notes"]
    assert any("leaves out the interquartile bar of odd B=4 T=128" in n for n in notes)
    fig = plots.speed_figure(results)
    assert any("IQR bar left out (median outside its IQR): odd B=4 T=128" in t.get_text() for t in fig.texts)


def _timed_beside(result: dict, reference: dict, theirs: dict[int, float], run: str) -> dict:
    """`result` as `eval --speed-side-by-side` writes it: the reference's speeds of the same run beside its own."""
    points = [dict(p, tokens_per_s=theirs[p["batch"]]) for p in result["speed"]["points"]]
    result["reference"] = {"path": reference["model"]["path"], "resolved": reference["model"]["path"], "label": "p"}
    result["model"]["resolved"] = result["model"]["path"]
    reference["model"]["resolved"] = reference["model"]["path"]
    result["speed"]["side_by_side"] = {
        "id": run,
        "points": points,
        "reference_label": reference["label"],
        "reference_resolved": reference["model"]["path"],
    }
    return result


def test_the_speed_plot_draws_the_side_by_side_speed_ups_not_the_speeds_of_separate_runs(tmp_path):
    # The demo: the parent's own run at one load (501 tok/s), each child timed beside the parent in its own run.
    parent = fake_result("parent", "parent", 8, 10.0, 1024, {1: 501.0, 4: 900.0})
    child = fake_result("uptrained", "uptrained", 2, 12.0, 256, {1: 335.0, 4: 700.0})
    child = _timed_beside(child, parent, {1: 330.0, 4: 350.0}, "run-2")
    fig = plots.speed_figure([parent, child])
    ax = fig.axes[0]
    ys = sorted(float(y) for line in ax.get_lines() if line.get_marker() == "o" for y in line.get_ydata())
    assert ys == pytest.approx(sorted([335.0 / 330.0, 700.0 / 350.0]))  # not 335 / 501
    assert "baseline" in ax.get_legend_handles_labels()[1][0] and "speed-up" in ax.get_ylabel()
