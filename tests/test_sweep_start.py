"""A sweep says how long it will take before it starts, and its first phases (the parent's evaluation, the
one calibration pass) show progress bars: it printed two static lines and no bar for its first 14 minutes."""

from __future__ import annotations

import pytest
from test_sweep import CAL_TOKENS, EVAL_TOKENS, tiny  # noqa: F401 (tiny: the fixture)

import mha2gqa.convert.calibration
import mha2gqa.eval.run
from mha2gqa.sweep import SweepOptions, sweep


class Stop(Exception):
    """Ends the sweep once its first phases have been seen."""


def test_the_first_phases_have_bars_and_the_time_is_said_first(tiny, tmp_path, monkeypatch):  # noqa: F811
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
    assert lines[0].startswith("sweep: estimated time about ") and "mha2gqa/estimates.py" in lines[0]
