"""Long runs say how long they will take before they start: `convert --dry-run`, the start of `sweep` and of
`demo` (mha2gqa/estimates.py). The estimates must reproduce the timings their rates were taken from."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from mha2gqa import embedded, estimates
from mha2gqa.cli import main
from mha2gqa.convert.inputs import layers_per_pass
from mha2gqa.convert.options import ConvertOptions, RefineOptions
from mha2gqa.convert.prepare import prepare
from mha2gqa.demo import pipeline
from mha2gqa.layouts import AttentionShape


def test_convert_dry_run_says_how_long_the_run_takes(tmp_path):
    args = ["convert", str(embedded.model_dir()), str(tmp_path / "dst"), "-g", "2", "--method", "calibrated"]
    result = CliRunner().invoke(main, [*args, "--calibration", "austen", "--dry-run"])
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("time: "))
    assert line.startswith("time: about 1 min (CPU rates of mha2gqa/estimates.py, measured at load 3-7 on 2 cores")


def test_the_embedded_refine_estimate_is_the_run_it_was_timed_from():
    # --refine-steps 10, global 0, 16,384 calibration tokens: 139.9 s at load 6.3
    options = ConvertOptions(
        2, calibration="austen", calibration_tokens=16384, refine=RefineOptions(steps=10, global_steps=0)
    )
    seconds = estimates.convert_seconds(prepare(embedded.model_dir(), options))
    assert 0.8 * 139.9 < seconds < 1.25 * 139.9


def smollm2_plan(refine: RefineOptions | None) -> SimpleNamespace:
    """SmolLM2-135M's shape and parameter count (9 / 3 heads, hidden 576, 30 layers), as prepare() plans it."""
    shape = AttentionShape("llama", layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576)
    return SimpleNamespace(
        shape=shape,
        options=ConvertOptions(1, method="calibrated", calibration="austen", refine=refine),
        checkpoint=SimpleNamespace(tensors={"all": SimpleNamespace(shape=(estimates.LARGE,))}),
        bytes_written=4 * estimates.LARGE,
        torch_reason="calibrated merge",
        gathers_statistics=True,
        calibration_memory=4 << 30,
        calibration_passes=-(-30 // layers_per_pass(4 << 30, 576)),  # 1: all 30 layers' statistics fit in 4 GiB
        calibration=SimpleNamespace(tokens=131072, sampled_tokens=0),  # austen, the default 131,072 tokens
        refine_budget=None if refine is None else SimpleNamespace(seq_len=512, blocks=72),
    )


@pytest.mark.parametrize(
    "refine, measured",
    [
        (RefineOptions(global_steps=0), 11 * 60 + 26),  # docs/refine.md: the default before the global stage
        (RefineOptions(), 21 * 60 + 17),  # the shipped default, one CLI run
    ],
    ids=["layer-wise", "default"],
)
def test_the_smollm2_estimates_are_its_measured_conversions(refine, measured):
    # Quiet 2 cores; the estimate adds start-up and writing, so it may run a little over.
    assert 0.8 * measured < estimates.convert_seconds(smollm2_plan(refine)) < 1.3 * measured


def test_the_parents_samples_are_counted_at_their_rate():
    plan = smollm2_plan(RefineOptions())
    text = estimates.convert_seconds(plan)
    plan.calibration = SimpleNamespace(tokens=131072, sampled_tokens=36864)
    sampled = estimates.convert_seconds(plan) - text
    assert sampled == pytest.approx(36864 * estimates.LARGE * estimates.RATES["sample"][1])
    assert 20 * 60 < sampled < 60 * 60  # 0.039 s a token measured at load 5, one thread


def test_rates_are_interpolated_between_the_two_timed_models():
    small, large = estimates.RATES["calibrate"]
    assert estimates.rate("calibrate", estimates.SMALL) == small
    assert estimates.rate("calibrate", estimates.LARGE) == pytest.approx(large)
    assert estimates.rate("calibrate", 10 * estimates.LARGE) == pytest.approx(large)  # beyond: the nearer one's
    assert large < estimates.rate("calibrate", 30_000_000) < small
    assert estimates.rate("train", estimates.LARGE) == estimates.RATES["train"][0]  # timed on one model only


def test_the_demo_says_its_time_before_it_starts(tmp_path, monkeypatch):
    lines = []
    monkeypatch.setattr(pipeline, "_run_stages", lambda *args: lines.append("stages ran") or {})
    pipeline.run_demo(tmp_path / "demo", quick=True, echo=lines.append, progress=False)
    assert lines[-1] == "stages ran" and lines[0].startswith("estimated time: about ")
    assert "evaluations about" in lines[0] and "uptraining about" in lines[0]
    full = estimates.demo_seconds(pipeline.DemoSettings.make(False, None), estimates.SMALL, 61_440, cloze=True)
    quick = estimates.demo_seconds(pipeline.DemoSettings.make(True, None), estimates.SMALL, 12_288, cloze=True)
    assert sum(quick.values()) < sum(full.values())


def test_the_held_out_novels_tokens_are_guessed_from_its_size():
    assert (
        0.7 * estimates.HELDOUT_TOKENS
        < estimates.text_tokens(str(embedded.heldout_path()))
        < 1.4 * estimates.HELDOUT_TOKENS
    )


def test_the_sweep_line_counts_every_candidate():
    plans = [prepare(embedded.model_dir(), ConvertOptions(g, calibration="austen")) for g in (4, 2, 1)]
    one = estimates.sweep_seconds(plans[:1], estimates.SMALL, 8192, 131072)
    three = estimates.sweep_seconds(plans, estimates.SMALL, 8192, 131072)
    assert three > one > estimates.calibration_seconds(131072, estimates.SMALL)
    line = estimates.sweep_start_line(plans, str(embedded.heldout_path()), 8192, 131072)
    assert line.startswith("sweep: estimated time about ") and "load 3-7" in line


@pytest.mark.parametrize(
    "seconds, text",
    [(3, "about 5 s"), (42, "about 40 s"), (200, "about 3 min"), (6540, "about 1 h 50 min"), (7200, "about 2 h")],
)
def test_durations_are_rounded_as_an_estimate_deserves(seconds, text):
    assert estimates.duration(seconds) == text
