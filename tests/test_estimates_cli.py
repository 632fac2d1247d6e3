"""Each long command says its estimate before it starts and what it took at the end, in its own output, and eval's
progress bars say which model, domain and stage they count (issue 36: four unlabelled bars for 17 minutes). The
rates here are the tests' own file (tests/test_estimates.py), so the lines are known before they are printed."""

from __future__ import annotations

import re

from click.testing import CliRunner
from test_estimates import fixed_rates  # noqa: F401 (the fixture)
from tiny_models import SAMPLE_TEXT, save_tiny_family
from uptrain_helpers import corpus, recipe_file

from mha2gqa.cli import main

ESTIMATE = re.compile(r"^estimate: about \d+ (s|min)(, peak memory about [\d.]+ [KMG]iB)? \((.*)\)$", re.M)


def _said(output: str) -> tuple[list[str], str]:
    """The stages the estimate line lists, and the time-taken line (as a terminal shows them: what follows a bar's
    last carriage return)."""
    output = "\n".join(line.split("\r")[-1] for line in output.split("\n"))
    found = ESTIMATE.search(output)
    assert found, output[-3000:]
    stages = [part.rsplit(" ", 1)[0] for part in found.group(3).split("; ")[0].split(", ")]
    took = re.search(r"^took .* \(estimated about .*\)$", output, re.M)
    assert took and took.start() > found.start(), output[-3000:]
    return stages, took.group(0)


def test_eval_says_its_estimate_labels_each_bar_and_says_what_it_took(tmp_path, fixed_rates):  # noqa: F811
    root = save_tiny_family(tmp_path, {"parent": 4, "gqa": 1})
    (root / "a.txt").write_text(SAMPLE_TEXT)
    (root / "b.txt").write_text(SAMPLE_TEXT[::-1])
    args = ["eval", str(root / "gqa"), "--reference", str(root / "parent"), "--data", f"prose={root / 'a.txt'}"]
    args += ["--data", f"code={root / 'b.txt'}", "--context", "16", "--speed", "off", "--out", str(tmp_path / "r.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    stages, _ = _said(result.stderr)
    assert stages == ["start", "load", "quality: prose", "quality: code", "kv cache"]
    assert "gqa · prose · perplexity, KL vs parent" in result.stderr and "gqa · code · perplexity" in result.stderr
    assert "windows:" not in result.stderr  # no bar without its model and stage


def test_a_calibrated_conversion_says_its_estimate_and_what_it_took(tmp_path, fixed_rates):  # noqa: F811
    root = save_tiny_family(tmp_path, {"parent": 4})
    (root / "cal.txt").write_text(SAMPLE_TEXT * 4)
    args = ["convert", str(root / "parent"), str(tmp_path / "dst"), "-g", "2", "--method", "calibrated"]
    result = CliRunner().invoke(main, [*args, "--calibration", str(root / "cal.txt"), "--calibration-tokens", "512"])
    assert result.exit_code == 0, result.output
    stages, _ = _said(result.stderr)
    assert stages == ["start", "load", "calibrate", "merge", "check", "metadata"]  # the check: main's, after the write


def test_uptrain_says_its_estimate_and_what_it_took(tmp_path, fixed_rates):  # noqa: F811
    root = save_tiny_family(tmp_path, {"model": 4})
    recipe = recipe_file(
        tmp_path / "r.yaml",
        model=str(root / "model"),
        output_dir=str(tmp_path / "out"),
        data={"train": str(corpus(tmp_path / "train.jsonl"))},
        budget={"max_steps": 3},
    )
    result = CliRunner().invoke(main, ["uptrain", "--recipe", str(recipe)])
    assert result.exit_code == 0, result.output
    stages, took = _said(result.output)
    assert stages == ["start", "load", "train", "save"] and took.startswith("took ")
