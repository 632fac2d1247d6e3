"""`mha2gqa uptrain --dry-run`: the recipe as resolved, the data it reads or samples, its steps and tokens, its
time and peak memory, before torch starts and with nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from uptrain_helpers import corpus, recipe_file, tiny_model_dir

from mha2gqa.cli import main
from mha2gqa.files.checkpoint import SafetensorsCheckpoint
from mha2gqa.uptrain import load_recipe, plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dry_run")
    return {
        "model": tiny_model_dir(root / "model", seed=1),
        "teacher": tiny_model_dir(root / "teacher"),
        "train": corpus(root / "train.jsonl"),
        "root": root,
    }


def _recipe(tmp_path, tiny, **keys) -> Path:
    keys = {
        "model": str(tiny["model"]),
        "output_dir": str(tmp_path / "out"),
        "data": {"train": str(tiny["train"])},
        **keys,
    }
    return recipe_file(tmp_path / "r.yaml", **keys)


def _dry_run(path, *overrides):
    return CliRunner().invoke(main, ["uptrain", "--recipe", str(path), "--dry-run", *overrides], catch_exceptions=False)


def test_the_dry_run_says_the_run_and_writes_nothing(tmp_path, tiny):
    path = _recipe(tmp_path, tiny, distill={"teacher": str(tiny["teacher"])})
    result = _dry_run(path, "optim.lr=1e-4")
    assert result.exit_code == 0, result.output
    out = result.output
    # the recipe as resolved: every key, with the override and its absolute paths
    resolved = yaml.safe_load("\n".join(line[2:] for line in out.splitlines()[1:] if line.startswith("  ")))
    assert resolved["optim"]["lr"] == 1e-4 and resolved["data"]["train"] == [str(tiny["train"])]
    assert resolved == {**load_recipe(path, ["optim.lr=1e-4"]).to_dict()}
    parameters = sum(info.nbytes // 4 for info in SafetensorsCheckpoint(tiny["model"]).tensors.values())
    assert f"model: {tiny['model']} ({parameters:,} parameters; trains all: {parameters:,})" in out
    assert f"distill.teacher: {tiny['teacher']} ({parameters:,} parameters)" in out
    assert "data.train: 1 file (train.jsonl), " in out
    assert "data.eval: unset: 8 blocks of 32 tokens held out of data.train" in out
    # recipe_file: 8 steps of 4 blocks x 32 tokens, an eval at the start and every 4 steps
    assert (
        "steps: 8 optimizer steps of 128 tokens (4 blocks x 32 tokens x grad_accum 1 x 1 process): 1,024 tokens" in out
    )
    assert "; 3 evals" in out and "time: about " in out and "peak memory: about " in out
    assert out.rstrip().endswith("(--dry-run: nothing written)")
    assert not (tmp_path / "out").exists()


def test_the_dry_run_counts_what_the_parent_samples(tmp_path, tiny):
    path = _recipe(
        tmp_path, tiny, distill={"teacher": str(tiny["teacher"])}, data={"train": ["parent"], "eval_blocks": 2}
    )
    result = _dry_run(path)
    assert result.exit_code == 0, result.output
    # 8 steps x 4 blocks, and 2 eval blocks sampled too (data.eval unset)
    assert (
        "data.train: parent: 34 blocks of 32 tokens sampled from distill.teacher before the first step" in result.output
    )
    mix = _dry_run(path, f"data.train=[parent:0.5,{tiny['train']}:0.5]")
    assert mix.exit_code == 0, mix.output
    assert "data.train: parent (50% of the blocks): 17 blocks of 32 tokens sampled" in mix.output
    assert "data.train: 1 file (train.jsonl), " in mix.output and "(50% of the blocks)" in mix.output


def test_a_bad_recipe_is_refused_as_without_it(tmp_path, tiny):
    result = _dry_run(_recipe(tmp_path, tiny), "seq_len=1")
    assert result.exit_code == 2 and "seq_len must be at least 2" in result.output
    assert not (tmp_path / "out").exists()


def test_the_dry_run_does_not_import_torch(tmp_path, tiny):
    path = _recipe(tmp_path, tiny, distill={"teacher": str(tiny["teacher"])})
    code = (
        "import sys\nfrom mha2gqa.cli import main\n"
        f"try:\n    main(['uptrain', '--recipe', {str(path)!r}, '--dry-run'])\n"
        "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "peak memory: about" in run.stdout and run.stdout.strip().endswith("exit 0 False"), run.stdout + run.stderr


@pytest.mark.parametrize("trainable", ["all", "attention", "kv", "lora"])
def test_the_trained_parameters_are_counted_as_training_selects_them(tmp_path, tiny, trainable):
    from transformers import AutoModelForCausalLM

    from mha2gqa.uptrain import lora
    from mha2gqa.uptrain.models import select_trainable

    recipe = load_recipe(
        _recipe(tmp_path, tiny, trainable=trainable, **({"lora": {"rank": 2}} if trainable == "lora" else {}))
    )
    model = AutoModelForCausalLM.from_pretrained(tiny["model"])
    if trainable == "lora":
        model = lora.add_adapters(model, recipe.lora)
    assert plan.model_size(str(tiny["model"]), recipe).trained == select_trainable(model, trainable)


def test_evals_and_steps_follow_the_budget(tmp_path, tiny):
    recipe = load_recipe(_recipe(tmp_path, tiny, budget={"max_steps": 10}, eval_every=4))
    assert plan.total_steps(recipe, 1) == 10 and plan.eval_count(recipe, 10) == 4  # 0, 4, 8 and the last
    recipe.eval_at_start, recipe.eval_every = False, 5
    assert plan.eval_count(recipe, 10) == 2  # 5 and 10
    tokens = load_recipe(_recipe(tmp_path, tiny, budget={"tokens": 1000, "max_steps": None}))
    assert plan.total_steps(tokens, 2) == 4  # 256 tokens a step on 2 processes, rounded up


def test_the_dry_runs_time_is_the_runs_own_estimate(tmp_path, tiny):
    # one plan, two sayings: `uptrain --dry-run`'s time and the estimate the run says before it loads the models
    from mha2gqa.estimates import Machine, uptrain_stages

    recipe = load_recipe(_recipe(tmp_path, tiny, distill={"teacher": str(tiny["teacher"])}), [])
    run = plan.plan_run(recipe)
    work = run.work()
    assert work.parameters == run.student.parameters and work.teacher_parameters == run.teacher.parameters
    assert work.tokens == run.tokens == 1024 and work.evals == 3 and work.trained == run.student.trained
    estimate = plan.uptrain_estimate(recipe, 1, Machine(1.0, None, "none"))
    assert [stage.name for stage in estimate.stages] == ["start", "load", "train", "save"]
    assert estimate.seconds() == pytest.approx(run.seconds())
    assert sum(stage.seconds() for stage in uptrain_stages(work)) == pytest.approx(run.seconds())
    assert estimate.peak_bytes == plan.peak_memory(recipe, run.student, run.teacher).total
