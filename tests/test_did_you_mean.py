"""A mistyped local path gets a "did you mean", as a mistyped flag or recipe key does (issue 39: `smoll` for
`smol` got none): reading.near_miss finds the existing path one typo away, and every "no such file" message
that names a local path ends with it."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import save_tiny_model

from mha2gqa.cli import main
from mha2gqa.files.reading import did_you_mean, near_miss


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working folder holding runs/smol (a tiny model) and notes/held.txt."""
    save_tiny_model(tmp_path / "runs" / "smol")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "held.txt").write_text("some held-out text " * 20)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def test_the_path_one_typo_away_is_found_at_the_part_that_is_missing(here):
    assert near_miss("runs/smoll") == Path("runs/smol")
    assert near_miss("runz/smol/config.json") == Path("runs/smol/config.json")  # a folder on the way
    assert near_miss(here / "notes" / "hel.txt") == here / "notes" / "held.txt"
    assert near_miss("runs/smol") is None  # it exists
    assert near_miss("runs/llama") is None  # nothing close
    assert near_miss("runs/smoll/missing.txt") is None  # the corrected path must exist too
    assert did_you_mean("runs/smoll") == " (did you mean runs/smol?)"
    assert did_you_mean("runs/elsewhere") == ""


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["convert", "runs/smoll", "out", "-g", "2"],
            "runs/smoll: no such directory (runs/ is a local folder here; did you mean runs/smol?)",
        ),
        (["convert", "smoll", "out", "-g", "2"], None),  # from inside runs/: a bare name, offline hub
        (
            ["eval", "runs/smol", "--data", "notes/hel.txt"],
            "--data notes/hel.txt: no such file or folder (did you mean notes/held.txt?)",
        ),
        (["eval", "runs/smol", "--reference", "runs/smoll"], "did you mean runs/smol?"),
        (["report", "runs/smol/eval.jsn", "--out", "rep"], None),
        (
            ["uptrain", "--recipe", "runs/smol/config.jsn"],
            "recipe runs/smol/config.jsn: no such file (did you mean runs/smol/config.json?)",
        ),
    ],
)
def test_a_mistyped_local_path_is_refused_with_the_one_it_may_mean(here, monkeypatch, args, words):
    if args[1] == "smoll":
        monkeypatch.chdir(here / "runs")
        words = "smoll is not a local directory (did you mean smol?) and the hub is offline"
    if args[0] == "report":
        (here / "runs" / "smol" / "eval.json").write_text("{}")
        words = "runs/smol/eval.jsn: no such result file (did you mean runs/smol/eval.json?)"
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert words in result.output, result.output
    assert not (here / "out").exists() and not (here / "rep").exists()
