"""Recipes: typed loading, key=value overrides, errors collected together, every shipped recipe valid."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain.recipe import Recipe, all_keys, describe
from mha2gqa.uptrain.recipe_load import load_recipe

ROOT = Path(__file__).resolve().parents[1]
# recipes/ and the ones shipped inside the package (the demo's)
RECIPES = sorted((ROOT / "recipes").glob("*.yaml")) + sorted((ROOT / "mha2gqa" / "demo").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
# recipes/bench/: the benchmarks' own, not shipped for users; bench/calibrated_uptrain.py fills in model, output_dir and the token count
BENCH_RECIPES = {
    "austen-small-pretrain.yaml": [],
    "calibrated-uptrain.yaml": ["model=m", "output_dir=o", "budget.pretrain_tokens=1000"],
    "smollm2-distill-parent-cpu.yaml": ["model=m", "output_dir=o", "distill.teacher=t"],
}


@pytest.fixture
def valid(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    # A config.json that reads as one (the recipe check refuses malformed ones); no weights needed here.
    (model / "config.json").write_text(
        '{"model_type": "llama", "num_attention_heads": 4, "hidden_size": 32, "num_hidden_layers": 2}'
    )
    data = tmp_path / "train.txt"
    data.write_text("hello\n")
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "output_dir": str(tmp_path / "out"),
                "data": {"train": str(data)},
                "budget": {"max_steps": 10},
            }
        )
    )
    return path


def test_loads_typed_values_and_applies_overrides(valid):
    r = load_recipe(
        valid,
        [
            "optim.lr=2e-4",
            "optim.betas=[0.8, 0.9]",
            "seq_len=64.0",
            "mixed_precision=no",
            "budget.max_steps=1_000",
            "data.eval_blocks=3",
            "trainable=kv",
        ],
    )
    assert isinstance(r, Recipe)
    assert r.optim.lr == pytest.approx(2e-4) and isinstance(r.optim.lr, float)  # YAML reads 2e-4 as text
    assert r.optim.betas == (0.8, 0.9)
    assert r.seq_len == 64 and isinstance(r.seq_len, int)
    assert r.mixed_precision == "no"  # YAML 1.1 reads a bare `no` as false
    assert r.budget.max_steps == 1000
    assert r.data.eval_blocks == 3 and r.trainable == "kv"
    assert isinstance(r.data.train, list) and len(r.data.train) == 1
    assert r.to_dict()["optim"]["betas"] == [0.8, 0.9]


def test_every_problem_is_reported_together_each_naming_its_key(valid):
    with pytest.raises(InputError) as err:
        load_recipe(valid, ["sed_len=3", "micro_batch_size=two", "data.train=missing.txt", "optim.schedule=step"])
    message = str(err.value)
    assert "4 problems" in message
    assert "unknown key sed_len (did you mean seq_len?)" in message
    assert "micro_batch_size: expected a number, got 'two'" in message
    assert "data.train missing.txt: no such file or folder" in message
    assert "optim.schedule: expected one of cosine, linear, constant, got 'step'" in message
    assert "\n" not in message  # the CLI shows it as one line


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["budget.max_steps=null"], "set exactly one of budget.max_steps, budget.tokens, budget.alpha (got none)"),
        (
            ["budget.tokens=100"],
            "(got budget.max_steps, budget.tokens): unset the one(s) you do not want with budget.max_steps=null",
        ),
        (
            ["budget.max_steps=null", "budget.alpha=0.05", "budget.pretrain_tokens=1000", "budget.tokens=10"],
            "(got budget.tokens, budget.alpha): unset the one(s) you do not want with budget.alpha=null",
        ),
        (["budget.max_steps=null", "budget.alpha=0.05"], "budget.alpha needs budget.pretrain_tokens"),
        (["budget.max_steps=0"], "budget.max_steps=0 must be positive"),
        (["seq_len=1"], "seq_len must be at least 2"),
        (["optim.betas=[0.9]"], "optim.betas: expected a list of 2 numbers"),
        (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0 must be in [0, 1]"),
        (["distill.kl_weight=1.5"], "distill.kl_weight=1.5 must be in [0, 1]"),
        (["init_from_config=cfg.json"], "set exactly one of model (to uptrain) and init_from_config"),
        (["output_dir=null"], "output_dir is required"),
        (["model=nobody/nothing"], "model=nobody/nothing is not a local directory and the hub is offline"),
        (["optim=3"], "optim is a section: give its keys (optim.lr, "),
        (["oops"], "override 'oops' is not key=value"),
    ],
)
def test_rule_violations_name_the_key(valid, overrides, expected):
    with pytest.raises(InputError, match=re.escape(expected)):
        load_recipe(valid, overrides)


def test_missing_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_recipe(bad)


def test_data_folder_and_mixed_formats(tmp_path, valid):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    (folder / "b.jsonl").write_text('{"text": "b"}\n')
    with pytest.raises(InputError, match=r"data.train mixes formats \(json, text\)"):
        load_recipe(valid, [f"data.train={folder}"])
    (folder / "b.jsonl").unlink()
    assert load_recipe(valid, [f"data.train={folder}"]).data.train == [str(folder)]


def test_every_key_is_documented():
    rows = describe()
    assert [key for key, _, _ in rows] == all_keys()
    undocumented = [key for key, _, doc in rows if not doc]
    assert undocumented == []
    assert ("optim.lr", "0.0001", "Peak learning rate of AdamW.") in rows


def test_cli_keys_and_one_line_errors(valid):
    from mha2gqa.cli import main

    listing = CliRunner().invoke(main, ["uptrain", "--keys"])
    assert listing.exit_code == 0 and "distill.temperature (default 1.0)" in listing.output
    result = CliRunner().invoke(main, ["uptrain", "--recipe", str(valid), "sed=1", "optim.lr=-1"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("Error: recipe ")
    assert "unknown key sed (did you mean seed?)" in result.output and "optim.lr=-1.0 must be positive" in result.output


def test_shipped_recipes_exist():
    names = {p.name for p in RECIPES if p.parent.name == "recipes" and p.parent.parent == ROOT}
    assert {"tiny-cpu.yaml", "llama2-7b-gqa8-fsdp.yaml", "llama-1b-gqa-1gpu.yaml"} <= names
    assert {"ddp.yaml", "fsdp.yaml", "zero3.yaml"} <= {p.name for p in ACCELERATE_CONFIGS}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_recipe_is_valid_and_starts_with_its_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# "), "the first line must be a comment holding the command"
    command = re.search(r"(mha2gqa uptrain|-m mha2gqa\.uptrain) --recipe (\S+)", first)
    assert command, f"no uptrain command in {first!r}"
    assert command.group(2) == str(path.relative_to(ROOT))
    for config in re.findall(r"--config_file (\S+)", first):
        assert (ROOT / config).is_file(), f"{config} named in {path.name} does not exist"
    recipe = load_recipe(path, [], validate_files=False)  # its model/data live on the machine it is for
    assert recipe.output_dir


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] in {"MULTI_GPU", "FSDP", "DEEPSPEED"}
    assert config["num_processes"] >= 1 and config["mixed_precision"] == "bf16"


def test_overriding_the_budget_of_a_recipe_that_sets_alpha_names_alpha_null(valid):
    """The demo's recipe sets budget.alpha; budget.max_steps=5 on it must say how to unset alpha."""
    demo = ROOT / "mha2gqa" / "demo" / "demo-uptrain.yaml"
    with pytest.raises(InputError) as err:
        load_recipe(demo, ["budget.max_steps=5"], validate_files=False)
    assert "(got budget.max_steps, budget.alpha): unset the one(s) you do not want with budget.alpha=null" in str(
        err.value
    )
    load_recipe(demo, ["budget.max_steps=5", "budget.alpha=null"], validate_files=False)  # and that works


def test_bench_recipes_are_valid_and_named_by_their_bench():
    """Every recipe under recipes/bench/ loads (with what its bench script fills in) and names the command it is for."""
    folder = ROOT / "recipes" / "bench"
    assert {p.name for p in folder.glob("*.yaml")} == set(BENCH_RECIPES)
    for name, overrides in BENCH_RECIPES.items():
        first = (folder / name).read_text().splitlines()[0]
        command = re.search(r"(?:mha2gqa uptrain --recipe|python) (\S+)", first)
        assert command and (ROOT / command.group(1)).is_file(), first
        assert load_recipe(folder / name, overrides, validate_files=False).output_dir
    init = load_recipe(folder / "austen-small-pretrain.yaml", [], validate_files=False).init_from_config
    assert (ROOT / init).is_file()


def test_the_exclusive_groups_are_declared_on_their_keys():
    """budget's three units and the model's two sources are each a one_of group: the checks (and the budget's
    message, in the keys' order) read the groups from the schema instead of a list of their own."""
    from mha2gqa.uptrain.recipe import BudgetConfig, group_keys

    assert group_keys(BudgetConfig, "budget") == ("max_steps", "tokens", "alpha")
    assert group_keys(Recipe, "source") == ("model", "init_from_config")
    assert group_keys(Recipe, "budget") == () and BudgetConfig().max_steps is None


def test_every_shipped_recipe_is_in_the_docs_table():
    """docs/uptrain.md's table of recipes lacked recipes/smollm2-distill-cpu.yaml, the real-model one: every
    recipes/*.yaml is a row by its file name, every recipe shipped inside the package by the name --recipe takes."""
    from mha2gqa.uptrain.recipe_load import shipped_recipes

    doc = (ROOT / "docs" / "uptrain.md").read_text()
    rows = set(re.findall(r"^\| `([\w.-]+)` \|", doc, flags=re.M))
    shipped = {p.name for p in (ROOT / "recipes").glob("*.yaml")} | set(shipped_recipes())
    assert {"distill-parent-cpu", "smollm2-distill-cpu.yaml"} <= shipped
    assert shipped <= rows, f"recipes missing from docs/uptrain.md's table: {sorted(shipped - rows)}"
    assert rows <= shipped, f"docs/uptrain.md's table names recipes that do not exist: {sorted(rows - shipped)}"


def test_a_model_made_by_the_recipes_first_line_is_refused_with_that_command(tmp_path, monkeypatch):
    """The README's `mha2gqa uptrain --recipe recipes/austen-gqa-parent.yaml` names a model that the convert on
    the recipe's first line makes: the refusal names that command (it looked the path up on the hub)."""
    from mha2gqa.cli import main

    monkeypatch.chdir(tmp_path)  # runs/austen-gqa2 does not exist here
    result = CliRunner().invoke(main, ["uptrain", "--recipe", str(ROOT / "recipes" / "austen-gqa-parent.yaml")])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert (
        "model=runs/austen-gqa2 does not exist yet: the recipe's first line makes it, run that first "
        "(mha2gqa convert mha2gqa/data/austen-mha runs/austen-gqa2 --groups 2), or set model= to a model you have"
    ) in result.output
    assert "hub" not in result.output and not (tmp_path / "runs").exists()
    # a recipe of one's own: the command before `&&` is what makes it; once it exists, no word of it
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "# mha2gqa convert SRC made --groups 2 && mha2gqa uptrain --recipe r.yaml\n"
        "model: made\noutput_dir: out\ndata: {train: [t.txt]}\nbudget: {max_steps: 1}\n"
    )
    (tmp_path / "t.txt").write_text("hello\n")
    with pytest.raises(InputError, match=r"model=made does not exist yet: .* \(mha2gqa convert SRC made --groups 2\)"):
        load_recipe(recipe)
    (tmp_path / "made").mkdir()
    (tmp_path / "made" / "config.json").write_text(
        '{"model_type": "llama", "num_attention_heads": 4, "hidden_size": 32, "num_hidden_layers": 2}'
    )
    assert load_recipe(recipe).model == "made"
