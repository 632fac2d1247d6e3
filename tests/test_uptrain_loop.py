"""The uptraining loop in one process on a tiny model: learning, output, resume, divergence, inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from uptrain_helpers import corpus, metrics, recipe_file, tiny_model_dir

from mha2gqa.records.provenance import latest, lineage
from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain import load_recipe, train
from mha2gqa.uptrain.data import MemoryBatches, build_data
from mha2gqa.uptrain.distill import kl_teacher_student
from mha2gqa.uptrain.guard import TrainingDiverged

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("uptrain")
    model = tiny_model_dir(root / "model")
    (model / "mha2gqa.json").write_text(json.dumps({"conversion": {"groups": 2, "method": "mean"}}))
    teacher = tiny_model_dir(root / "teacher", seed=1)  # another model: a teacher that is the model is refused
    train_data, eval_data = corpus(root / "train.jsonl"), corpus(root / "eval.jsonl", 30, seed=1)
    return {"model": model, "teacher": teacher, "train": train_data, "eval": eval_data}


def _recipe(tmp_path, tiny, overrides=(), **keys):
    keys.setdefault("model", str(tiny["model"]))
    keys.setdefault("output_dir", str(tmp_path / "out"))
    data = {"train": str(tiny["train"]), **keys.pop("data", {})}
    return load_recipe(recipe_file(tmp_path / "r.yaml", data=data, **keys), list(overrides))


def test_loss_goes_down_and_the_result_is_a_standard_checkpoint(tmp_path, tiny):
    recipe = _recipe(tmp_path, tiny, budget={"max_steps": 12})
    out = train(recipe)
    lines = metrics(out)
    assert [ln["step"] for ln in lines] == [0, 2, 4, 6, 8, 10, 12]
    assert all(ln["tokens"] == ln["step"] * 32 * 4 for ln in lines)
    assert lines[0]["loss"] is None and all(isinstance(ln["loss"], float) and ln["lr"] > 0 for ln in lines[1:])
    evals = [ln for ln in lines if "eval_loss" in ln]
    assert [ln["step"] for ln in evals] == [0, 4, 8, 12]
    assert all(ln["eval_ppl"] == pytest.approx(math.exp(ln["eval_loss"])) for ln in evals)
    assert lines[-1]["loss"] < lines[1]["loss"] - 0.5  # it learns
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5

    # plain transformers loads the result; its held-out loss is the one reported
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert AutoTokenizer.from_pretrained(out).eos_token_id == 2
    eval_blocks = build_data(recipe, AutoTokenizer.from_pretrained(out), 0, 1, show_progress=False).eval
    with torch.no_grad():
        loss = model(input_ids=eval_blocks[:4].long(), labels=eval_blocks[:4].long()).loss
        loss2 = model(input_ids=eval_blocks[4:].long(), labels=eval_blocks[4:].long()).loss
    assert (loss + loss2).item() / 2 == pytest.approx(evals[-1]["eval_loss"], rel=1e-4)

    conversion, up = lineage(out)  # the source's (old-schema) record, then this run's
    assert conversion == {"stage": "conversion", "version": None, "groups": 2, "method": "mean"}
    assert up["stage"] == "uptrain"
    assert up["steps"] == 12 and up["tokens_seen"] == 12 * 128 and up["world_size"] == 1
    assert up["recipe"]["optim"]["lr"] == pytest.approx(3e-3) and up["source"]["model"] == str(tiny["model"])
    assert up["final_eval_loss"] == pytest.approx(evals[-1]["eval_loss"]) and up["date"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def _weights(out: Path) -> dict:
    return load_file(str(out / "model.safetensors"))


def _trace(out: Path) -> list:
    lines = [json.loads(ln) for ln in (out / "trace" / "rank0.jsonl").read_text().splitlines()]
    return [(ln["micro"], ln["blocks"]) for ln in lines if "micro" in ln]


def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(tmp_path, tiny):
    keys = dict(grad_accum=2, trace_samples=True, budget={"max_steps": 7}, eval_every=0, save_every=2)
    straight = train(_recipe(tmp_path / "a", tiny, **keys))
    first = train(_recipe(tmp_path / "b", tiny, exit_after_steps=3, **keys))
    assert not (first / "model.safetensors").exists()
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    resumed = train(_recipe(tmp_path / "b", tiny, **keys), resume=True)
    assert resumed == first
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    assert _trace(resumed) == _trace(straight)  # the same blocks in the same order
    assert metrics(resumed)[-1]["loss"] == pytest.approx(metrics(straight)[-1]["loss"])
    assert latest(resumed, "uptrain")["resumed_from_step"] == 3


def test_resume_checks(tmp_path, tiny):
    with pytest.raises(InputError, match="no finished checkpoint"):
        train(_recipe(tmp_path, tiny), resume=True)
    train(_recipe(tmp_path, tiny, exit_after_steps=1, save_every=0))
    with pytest.raises(InputError, match=r"changed keys that fix the run's data and parameters \(seq_len: 32 -> 16\)"):
        train(_recipe(tmp_path, tiny, seq_len=16), resume=True)
    with pytest.raises(InputError, match="is not empty: pass --resume"):
        train(_recipe(tmp_path, tiny))


def _seed_poisoning_step(recipe, tokenizer, token: int, step_range=range(2, 5)) -> tuple[int, int]:
    """A data seed whose shuffled order first feeds `token` at an optimizer step in step_range."""
    blocks = build_data(recipe, tokenizer, 0, 1, show_progress=False).train.blocks
    for seed in range(200):
        batches = MemoryBatches(blocks, recipe.micro_batch_size, 0, 1, seed)
        first = next(m for m in range(10_000) if (batches.batch(m) == token).any()) + 1
        if first in step_range:
            return seed, first
    raise AssertionError("no seed puts the poisoned block early enough")


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, tiny):
    model_dir = tiny_model_dir(tmp_path / "poisoned")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token = tokenizer("Z", add_special_tokens=False)["input_ids"][-1]
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["model.embed_tokens.weight"][token] = float("nan")  # any batch holding "Z" gives a NaN loss
    from safetensors.torch import save_file

    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    data = tmp_path / "z.jsonl"
    data.write_text(tiny["train"].read_text() + json.dumps({"text": "Z Z Z Z"}) + "\n")
    recipe = _recipe(
        tmp_path,
        tiny,
        model=str(model_dir),
        save_every=1,
        keep_last=1,
        eval_at_start=False,
        eval_every=0,
        data={"train": str(data), "eval": str(tiny["eval"])},
        budget={"max_steps": 500},
    )
    recipe.seed, bad_step = _seed_poisoning_step(recipe, tokenizer, token)
    with pytest.raises(TrainingDiverged) as err:
        train(recipe)
    assert f"training diverged at step {bad_step}: loss nan" in str(err.value)
    last_good = tmp_path / "out" / "checkpoints" / f"step-{bad_step - 1:08d}"
    assert f"the last good checkpoint is {last_good}" in str(err.value)
    assert [p.name for p in last_good.parent.iterdir()] == [last_good.name]
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_bad_input_writes_nothing(tmp_path, tiny):
    austen_tokenizer = ROOT / "mha2gqa" / "data" / "austen-mha"
    recipe = _recipe(tmp_path, tiny, tokenizer=str(austen_tokenizer))
    with pytest.raises(InputError, match="the model has vocab_size=128: use the model's own tokenizer"):
        train(recipe)
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="fewer than one batch"):
        train(_recipe(tmp_path, tiny, micro_batch_size=4096, data={"eval_blocks": 1}))  # 4,096: limits.py's most
    assert not (tmp_path / "out").exists()


def test_trainable_kv_changes_only_keys_and_values(tmp_path, tiny):
    out = train(_recipe(tmp_path, tiny, trainable="kv", budget={"max_steps": 3}, eval_every=0))
    before, after = _weights(tiny["model"]), _weights(out)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    expected = sorted(k for k in before if ".k_proj." in k or ".v_proj." in k)
    assert changed == expected and len(expected) == 8  # 2 layers x k/v x weight/bias
    count = latest(out, "uptrain")["trainable_params"]
    assert count == sum(before[k].numel() for k in expected)


def test_kl_is_zero_for_identical_distributions_and_matches_the_definition():
    torch.manual_seed(0)
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    assert kl_teacher_student(t, t, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    p = torch.softmax(t / 2, -1)
    manual = (p * (torch.log_softmax(t / 2, -1) - torch.log_softmax(s / 2, -1))).sum(-1).mean() * 4
    assert kl_teacher_student(s, t, 2.0).item() == pytest.approx(manual.item(), rel=1e-5)


def test_distillation_mixes_kl_and_lm_loss(tmp_path, tiny):
    recipe = _recipe(
        tmp_path,
        tiny,
        log_every=1,
        eval_every=0,
        budget={"max_steps": 3},
        distill={"teacher": str(tiny["teacher"]), "kl_weight": 0.25, "temperature": 2.0},
    )
    out = train(recipe)
    losses = [ln["loss"] for ln in metrics(out)[1:]]
    # before the first update the student is the model as loaded: (1 - w) * LM + w * KL(teacher || it), at T = 2
    first = build_data(recipe, AutoTokenizer.from_pretrained(tiny["model"]), 0, 1, False).train.batch(0)
    with torch.no_grad():
        student, teacher = (AutoModelForCausalLM.from_pretrained(tiny[k]).eval() for k in ("model", "teacher"))
        lm = student(input_ids=first, labels=first).loss.item()
        kl = kl_teacher_student(student(input_ids=first).logits, teacher(input_ids=first).logits, 2.0).item()
    assert kl > 1e-3 and losses[0] == pytest.approx(0.75 * lm + 0.25 * kl, rel=1e-4)
    assert all(math.isfinite(x) for x in losses)


def test_distillation_after_updates_mixes_a_nonzero_kl(tmp_path, tiny):
    """At step 3 the student has moved. With a constant learning rate a 2-step run ends where the 3-step run stood
    before its third step, so that step's logged loss is (1 - w) * LM + w * T^2 * KL of the 2-step result against
    the teacher, on the third batch."""
    from mha2gqa.uptrain.steps import lm_loss

    keys = dict(
        log_every=1,
        eval_every=0,
        optim={"lr": 3e-3, "schedule": "constant", "warmup_steps": 0},
        distill={"teacher": str(tiny["teacher"]), "kl_weight": 0.25, "temperature": 2.0},
    )
    three = _recipe(tmp_path / "three", tiny, budget={"max_steps": 3}, **keys)
    losses = [ln["loss"] for ln in metrics(train(three))[1:]]
    two = train(_recipe(tmp_path / "two", tiny, budget={"max_steps": 2}, **keys))
    third = build_data(three, AutoTokenizer.from_pretrained(tiny["model"]), 0, 1, False).train.batch(2)
    student, teacher = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (two, tiny["teacher"]))
    with torch.no_grad():
        kl = kl_teacher_student(student(input_ids=third).logits, teacher(input_ids=third).logits, 2.0).item()
        lm = lm_loss(student, third).item()
    assert kl > 1e-3  # the student really differs from its teacher by now
    assert losses[2] == pytest.approx(0.75 * lm + 0.25 * kl, rel=1e-4)


def test_from_scratch_through_the_cli_with_the_shipped_tiny_recipe(tmp_path):
    from mha2gqa.cli import main

    args = [
        "uptrain",
        "--recipe",
        str(ROOT / "recipes" / "tiny-cpu.yaml"),
        f"output_dir={tmp_path / 'scratch'}",
        "budget.max_steps=2",
        "seq_len=32",
        "micro_batch_size=2",
        "eval_every=0",
        "data.eval_blocks=2",
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = tmp_path / "scratch"
    assert f"output: {out}" in result.output
    assert [s["stage"] for s in lineage(out)] == ["uptrain"]  # no source provenance to carry
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (128, 4, 4096)
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0
