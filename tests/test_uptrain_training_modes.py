"""uptrain's training modes: bf16/fp16 training and the cast back to the source dtype, one mixed precision per
process, trainable=attention on fused/per-head-norm layouts, gradient checkpointing that changes no number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import make_tiny_tokenizer, save_tiny_model
from uptrain_helpers import corpus, metrics, recipe_file, tiny_model_dir

from mha2gqa.records.provenance import latest
from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain import load_recipe, train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return corpus(tmp_path_factory.mktemp("data") / "train.jsonl", docs=80)


def _recipe(tmp_path, model, data, **keys):
    keys.setdefault("output_dir", str(tmp_path / "out"))
    return recipe_file(
        tmp_path / "r.yaml", model=str(model), data={"train": str(data), "eval_blocks": 2}, eval_every=0, **keys
    )


def _changed(before: Path, after: Path) -> set[str]:
    old, new = load_file(str(before / "model.safetensors")), load_file(str(after / "model.safetensors"))
    assert old.keys() == new.keys()
    return {k for k in old if not torch.equal(old[k].float(), new[k].float())}


# ---- bf16 ----


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_run_saves_back_in_the_half_precision_source_dtype(tmp_path, data, precision, dtype):
    """In its own process: accelerate fixes mixed precision for a process's life (the loop says so).
    Master weights train in fp32 under autocast; the result is cast back to the source's dtype."""
    model = tiny_model_dir(tmp_path / "model", dtype=dtype)
    recipe = _recipe(tmp_path, model, data, mixed_precision=precision, budget={"max_steps": 4}, log_every=1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mha2gqa.uptrain", "--recipe", str(recipe)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = tmp_path / "out"
    weights = load_file(str(out / "model.safetensors"))
    name = str(dtype).replace("torch.", "")
    assert {t.dtype for t in weights.values()} == {dtype}
    assert json.loads((out / "config.json").read_text())["dtype"] == name
    assert (
        latest(out, "uptrain")["saved_dtype"] == name
        and latest(out, "uptrain")["recipe"]["mixed_precision"] == precision
    )
    losses = [row["loss"] for row in metrics(out)[1:]]
    assert len(losses) == 4 and all(0 < x < 20 for x in losses)
    assert _changed(model, out)  # it trained


def test_a_second_mixed_precision_in_one_process_is_one_clear_line(tmp_path, data):
    from mha2gqa.uptrain.loop import _make_accelerator, _release

    model = tiny_model_dir(tmp_path / "model")
    first = load_recipe(_recipe(tmp_path, model, data, mixed_precision="no"))
    _release(_make_accelerator(first, tmp_path / "out"))  # the whole test process trains in fp32
    second = load_recipe(_recipe(tmp_path, model, data, mixed_precision="bf16"))
    with pytest.raises(
        InputError,
        match=r"mixed_precision=bf16: this Python process already trained with another "
        r"mixed_precision.*run this training in a process of its own",
    ):
        _make_accelerator(second, tmp_path / "out")


# ---- trainable=attention on fused qkv (phi3) and per-head k norms (stablelm) ----


@pytest.mark.parametrize("model_type", ["phi3", "stablelm"])
def test_trainable_attention_changes_exactly_the_attention_tensors(tmp_path, data, model_type):
    model = tmp_path / "model"
    save_tiny_model(model, model_type)
    make_tiny_tokenizer(model)
    out = train(load_recipe(_recipe(tmp_path, model, data, trainable="attention", budget={"max_steps": 2})))
    changed = _changed(model, out)
    attention = {k for k in load_file(str(model / "model.safetensors")) if ".self_attn." in k}
    assert changed == attention
    if model_type == "phi3":
        assert any("qkv_proj" in k for k in changed)
    else:
        assert any("k_layernorm.norms." in k for k in changed)  # the per-head key norms train too


# ---- gradient checkpointing ----


def test_gradient_checkpointing_is_used_and_changes_no_number(tmp_path, data, monkeypatch):
    from transformers import PreTrainedModel

    model = tiny_model_dir(tmp_path / "model")
    plain = train(load_recipe(_recipe(tmp_path / "a", model, data, budget={"max_steps": 3}, log_every=1)))
    calls = []
    enable = PreTrainedModel.activation_checkpointing_enable  # transformers 5.x's name (the old one warns)
    monkeypatch.setattr(
        PreTrainedModel, "activation_checkpointing_enable", lambda self, **kw: (calls.append(kw), enable(self, **kw))[1]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ckpt = train(
            load_recipe(
                _recipe(tmp_path / "b", model, data, budget={"max_steps": 3}, log_every=1, gradient_checkpointing=True)
            )
        )
    assert calls == [{"activation_checkpointing_kwargs": {"use_reentrant": False}}]
    ckpt_losses, plain_losses = ([r["loss"] for r in metrics(run)] for run in (ckpt, plain))
    # step 0 logs an eval before any training step: its loss is null in both runs, and only numbers compare
    assert [loss is None for loss in ckpt_losses] == [loss is None for loss in plain_losses]
    numbers = [(a, b) for a, b in zip(ckpt_losses, plain_losses) if a is not None]
    assert len(numbers) == 3
    assert [a for a, _ in numbers] == pytest.approx([b for _, b in numbers], rel=1e-5)
    for name, tensor in load_file(str(plain / "model.safetensors")).items():
        torch.testing.assert_close(load_file(str(ckpt / "model.safetensors"))[name], tensor, rtol=1e-5, atol=1e-6)


# ---- the public API wrappers ----
