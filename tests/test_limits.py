"""Every count a user types is bounded before work starts (limits.py): each integer option of each command (and
each list of integers) has an entry, and a value past either end is one line, exit 2, naming the flag, with no
model loaded."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from tiny_models import make_tiny_tokenizer, save_tiny_model

from mha2gqa.cli import main
from mha2gqa.cli.fields import TokenCount
from mha2gqa.runtime.limits import BOUNDS

# options whose value is a comma-separated list of counts (text on the command line), or a count or a word
LISTS = {
    "eval": {"--speed-batches", "--speed-contexts", "--retrieval-lengths"},
    "reproduce": {"--kv-heads"},
    "sweep": {"--groups"},
    "serve-bench": {"--concurrency", "--capacity-concurrency"},
}


def counted_options(command: click.Command) -> set[str]:
    """The options of `command` that take a whole number (a count, or a count or a word such as all or auto)."""
    found = set()
    for param in command.params:
        kind = param.type
        if isinstance(kind, (click.types.IntParamType, TokenCount)) or kind.name.startswith("INTEGER"):
            found.add(param.opts[0])
    return found


def test_every_integer_option_of_every_command_has_a_bound():
    commands = {name: main.commands[name] for name in BOUNDS if name != "uptrain"}  # a recipe's keys: below
    for name, command in main.commands.items():
        if name not in BOUNDS:
            assert not counted_options(command), f"{name}: {counted_options(command)} have no bound in limits.py"
    for name, command in commands.items():
        assert set(BOUNDS[name]) == counted_options(command) | LISTS.get(name, set()), name


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits") / "llama"
    save_tiny_model(path, "llama")
    make_tiny_tokenizer(path)
    return path


def arguments(command: str, src, tmp_path) -> list[str]:
    """What each command needs besides the flag under test, with no other error in it."""
    return {
        "convert": [str(src), str(tmp_path / "dst"), "-g", "1", "--dry-run"],
        "inspect": [str(src)],
        "eval": [str(src), "--out", str(tmp_path / "r.json")],
        "demo": ["--out", str(tmp_path / "demo"), "--dry-run"],
        "reproduce": ["--out", str(tmp_path / "rep"), "--dry-run"],
        "sweep": [str(src), "--out", str(tmp_path / "sweep"), "--dry-run"],
        "serve-bench": [str(src), str(tmp_path / "child")],
    }[command]


CASES = [
    (command, flag, end)
    for command, flags in BOUNDS.items()
    if command != "uptrain"  # a recipe's keys: below
    for flag in flags
    for end in ("most", "least")
]


@pytest.mark.parametrize(("command", "flag", "end"), CASES, ids=[" ".join(case) for case in CASES])
def test_a_count_past_its_bound_is_refused_before_any_work(command, flag, end, src, tmp_path, monkeypatch):
    import transformers

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the counts were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    bound = BOUNDS[command][flag]
    value = bound.most + 1 if end == "most" else bound.least - 1
    # read only with --refine, or --retrieval (each flag's own rule refuses it alone first)
    extra = ["--refine"] if flag.startswith("--refine-") else ["--retrieval"] if flag.startswith("--retrieval-") else []
    run = CliRunner().invoke(main, [command, *arguments(command, src, tmp_path), *extra, flag, str(value)])
    assert run.exit_code == 2, (run.output, run.exception)
    line = run.output.strip().splitlines()[-1]
    assert flag in line and str(value) in line.replace(",", "")
    if end == "most":
        assert f"must be at most {bound.most:,} ({bound.why})" in line
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "extra",
    [
        ["-g", "1", "--method", "calibrated"],
        ["--kv-heads-per-layer", "2,1"],
        ["--kv-budget", "0.5"],
        ["-g", "1", "--refine"],
    ],
)
def test_calibration_tokens_0_is_refused_on_every_path(extra, src, tmp_path):
    run = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "d"), *extra, "--calibration-tokens", "0"])
    assert run.exit_code == 2, run.output
    assert "--calibration-tokens 0 must be at least 1 (a stage that reads calibration text needs tokens" in run.output
    assert not (tmp_path / "d").exists()


def test_guarantees_list_every_bound():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "guarantees.md").read_text()
    for command, flags in BOUNDS.items():
        for flag, bound in flags.items():
            assert f"| {command} | `{flag}` | {bound.least:,} | {bound.most:,} | {bound.why} |" in text


def recipe_counts() -> set[str]:
    """Every integer key of an uptrain recipe (dotted for a section's), from the typed schema."""
    import dataclasses
    import typing

    from mha2gqa.uptrain.recipe import Recipe

    def walk(cls, prefix: str) -> set[str]:
        found, hints = set(), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if dataclasses.is_dataclass(kind):
                found |= walk(kind, f"{prefix}{f.name}.")
            elif kind is int or kind == (int | None):
                found.add(prefix + f.name)
        return found

    return walk(Recipe, "")


def test_every_integer_key_of_a_recipe_has_a_bound():
    assert set(BOUNDS["uptrain"]) == recipe_counts()


@pytest.mark.parametrize("key", sorted(BOUNDS["uptrain"]))
def test_a_recipe_count_past_its_most_is_refused_by_the_dry_run(key, src, tmp_path):
    from uptrain_helpers import corpus, recipe_file

    budget = {"budget": {"max_steps": None, "tokens": 1000}} if key == "budget.tokens" else {}
    budget = {"budget": {"max_steps": None, "alpha": 0.01}} if key == "budget.pretrain_tokens" else budget
    recipe = recipe_file(tmp_path / "r.yaml", model=str(src), output_dir=str(tmp_path / "out"),
                         data={"train": str(corpus(tmp_path / "t.jsonl"))}, **budget)  # fmt: skip
    bound = BOUNDS["uptrain"][key]
    run = CliRunner().invoke(main, ["uptrain", "--recipe", str(recipe), "--dry-run", f"{key}={bound.most + 1}"])
    assert run.exit_code == 2, run.output
    assert f"{key}={bound.most + 1:,} must be at most {bound.most:,} ({bound.why})" in run.output
    assert not (tmp_path / "out").exists()
