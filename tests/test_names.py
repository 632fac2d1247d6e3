"""Names the user types are read as meant or answered with what they may mean (issue 55, item 4): a recipe name
one typo from a shipped one gets a did-you-mean and an unknown one the shipped names; `--calibration a:0.75,b:0.25`
is the same as repeating the flag; a run folder is called the run of the command its marker names."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_helpers import assert_refused, cli

from mha2gqa.corpus.mix import parse_spec
from mha2gqa.files.run_folder import MARKER, validate_folder
from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain.recipe_load import recipe_path, shipped_recipes

EMBEDDED_SRC = "mha2gqa/data/austen-mha"


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


@pytest.mark.parametrize(
    "typed, meant", [("distil-parent-cpu", "distill-parent-cpu"), ("distill-parent-gpx", "distill-parent-gpu")]
)
def test_a_recipe_name_one_typo_from_a_shipped_one_gets_a_did_you_mean(here, typed, meant):
    found = cli("uptrain", "--recipe", typed, "--dry-run")
    assert_refused(found, f"recipe {typed}: no such file, nor a recipe shipped in the package (did you mean {meant}?)")


def test_an_unknown_recipe_name_is_answered_with_the_shipped_names(here):
    found = cli("uptrain", "--recipe", "my-recipe", "--dry-run")
    assert_refused(
        found,
        f"recipe my-recipe: no such file, nor a recipe shipped in the package (shipped: {', '.join(shipped_recipes())})",
    )


def test_a_shipped_recipe_named_with_its_suffix_is_the_shipped_one_and_a_local_file_wins(here):
    assert recipe_path("distill-parent-cpu.yaml") == recipe_path("distill-parent-cpu")
    assert recipe_path("distill-parent-cpu").is_file()
    (here / "distill-parent-cpu").write_text("model: x\n")
    assert recipe_path("distill-parent-cpu") == Path("distill-parent-cpu")
    (here / "mine.yaml").write_text("model: x\n")  # a local file one typo away keeps the path's own did-you-mean
    assert_refused(
        cli("uptrain", "--recipe", "mine.yml", "--dry-run"), "recipe mine.yml: no such file (did you mean mine.yaml?)"
    )


def test_commas_in_a_calibration_are_the_flag_repeated(here):
    assert (
        parse_spec("parent:0.75,austen:0.25")
        == parse_spec(["parent:0.75", "austen:0.25"])
        == [
            ("parent", 0.75),
            ("austen", 0.25),
        ]
    )
    assert parse_spec(["parent:3, austen:1"]) == [("parent", 3.0), ("austen", 1.0)]
    (here / "a,b.txt").write_text("text")  # an existing path with a comma in its name is read whole
    assert parse_spec("a,b.txt") == [("a,b.txt", None)]
    assert parse_spec({"parent": 0.5, "a,b": 0.5}) == [("parent", 0.5), ("a,b", 0.5)]


@pytest.mark.parametrize("spec, piece", [("parent:0,75", "'75'"), ("parent:0.5,,austen:0.5", "''"), ("austen,", "''")])
def test_a_comma_piece_that_names_no_text_is_refused_with_the_notation(here, spec, piece):
    with pytest.raises(
        InputError,
        match=f"--calibration {spec}: a comma separates texts, as repeating --calibration does, and {piece} names no text",
    ):
        parse_spec(spec)


def test_convert_plans_the_comma_form_as_the_repeated_flag(tmp_path):
    src = str(Path(__file__).resolve().parents[1] / EMBEDDED_SRC)
    args = ["convert", src, tmp_path / "dst", "-g", "2", "--method", "calibrated", "--dry-run"]
    comma = cli(*args, "--calibration", "parent:0.75,austen:0.25")
    repeated = cli(*args, "--calibration", "parent:0.75", "--calibration", "austen:0.25")
    assert comma.exit_code == 0 == repeated.exit_code, comma.output
    stage = [line for line in comma.output.splitlines() if line.startswith("stage 2: calibrate")]
    assert stage and "a mix of parent 75%, austen 25%" in stage[0]
    assert stage == [line for line in repeated.output.splitlines() if line.startswith("stage 2: calibrate")]
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("command", ["sweep", "reproduce"])
@pytest.mark.parametrize("force", [False, True])
def test_a_folder_marked_by_another_command_is_called_its_run(tmp_path, command, force):
    out = tmp_path / "demo-out"
    out.mkdir()
    (out / MARKER).write_text("demo\n")
    with pytest.raises(InputError, match=f"holds an earlier demo run \\(its {MARKER} says so\\), not a {command} run"):
        validate_folder(out, "--out", command, {"sweep.json"}, force)
    assert (out / MARKER).read_text() == "demo\n"


def test_a_marker_that_no_run_wrote_is_a_users_file(tmp_path):
    out = tmp_path / "out"
    (out / MARKER).mkdir(parents=True)
    (out / MARKER / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=f"holds files that are not a demo run \\({MARKER}\\)"):
        validate_folder(out, "--out", "demo", {"converted"}, True)
