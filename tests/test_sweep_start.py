"""A sweep says how long it will take before it starts, and its first phases (the parent's evaluation, the
one calibration pass) show progress bars: it printed two static lines and no bar for its first 14 minutes."""

from __future__ import annotations

import re

import pytest
from test_estimates import fixed_rates  # noqa: F401 (the tests' own rates: the fixture)
from test_sweep import CAL_TOKENS, EVAL_TOKENS, tiny  # noqa: F401 (tiny: the fixture)

import mha2gqa.convert.calibration
import mha2gqa.eval.run
from mha2gqa.estimates.costs import RUNTIME_BYTES
from mha2gqa.sweep import SweepOptions, sweep


class Stop(Exception):
    """Ends the sweep once its first phases have been seen."""


def test_the_first_phases_have_bars_and_the_time_is_said_first(tiny, tmp_path, monkeypatch, fixed_rates):  # noqa: F811
    seen, lines = [], []
    evaluate = mha2gqa.eval.run.evaluate

    def parent_evaluation(source, options):
        seen.append(("evaluate", options.progress))
        return evaluate(source, options=options)

    def calibration(*args, progress, **kwargs):
        seen.append(("calibrate", progress))
        raise Stop

    monkeypatch.setattr(mha2gqa.eval.run, "evaluate", parent_evaluation)
    monkeypatch.setattr(mha2gqa.convert.calibration, "load_source_model", calibration)
    options = SweepOptions(
        calibration=str(tiny / "cal.txt"),
        data=str(tiny / "eval.txt"),
        out=str(tmp_path / "out"),
        groups=(1,),
        methods=("mean",),
        max_tokens=EVAL_TOKENS,
        calibration_tokens=CAL_TOKENS,
        progress=True,
    )
    with pytest.raises(Stop):
        sweep(tiny / "src", options, echo=lines.append)
    assert seen == [("evaluate", True), ("calibrate", True)]
    assert lines[0].startswith("estimate: about ") and "candidate kv1-mean" in lines[0]
    assert "not scaled to this one: a probe would cost more than 2% of a run this short" in lines[0]  # a short sweep
    peak = re.search(r"peak memory about ([\d.]+) MiB", lines[0])  # a sweep said none (issue 39's table: "-")
    assert peak and float(peak.group(1)) >= RUNTIME_BYTES / 2**20  # torch and the libraries at least
    # --data in words, not the Python tuple it printed ("evaluating the parent on ('.../eval.txt',)")
    assert f"evaluating the parent on eval ({tiny / 'eval.txt'})" in "\n".join(lines)


def test_the_data_is_said_in_words():
    from mha2gqa.sweep.run import data_words

    assert data_words(("probe",)) == "the probe set (prose, code, python_docs, licences)"
    assert data_words(("a/persuasion.txt.gz",)) == "persuasion (a/persuasion.txt.gz)"
    assert data_words(("code=src/", "x.txt")) == "code (src/), x (x.txt)"
