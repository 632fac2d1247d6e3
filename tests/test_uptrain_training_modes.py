"""Paths no other test reached (issue 14 item 9): bf16/fp16 training and the cast back to the source dtype,
one mixed precision per process, trainable=attention on fused/per-head-norm layouts, gradient
checkpointing, the public API wrappers, the hub paths (mocked), the copy_file_range fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import make_tiny_tokenizer, save_tiny_model
from uptrain_helpers import corpus, metrics, recipe_file, tiny_model_dir

import mha2gqa
from mha2gqa.errors import InputError
from mha2gqa.provenance import latest
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
    enable = PreTrainedModel.gradient_checkpointing_enable
    monkeypatch.setattr(
        PreTrainedModel, "gradient_checkpointing_enable", lambda self, **kw: (calls.append(kw), enable(self, **kw))[1]
    )
    ckpt = train(
        load_recipe(
            _recipe(tmp_path / "b", model, data, budget={"max_steps": 3}, log_every=1, gradient_checkpointing=True)
        )
    )
    assert calls == [{"gradient_checkpointing_kwargs": {"use_reentrant": False}}]
    ckpt_losses, plain_losses = ([r["loss"] for r in metrics(run)] for run in (ckpt, plain))
    # step 0 logs an eval before any training step: its loss is null in both runs, and only numbers compare
    assert [loss is None for loss in ckpt_losses] == [loss is None for loss in plain_losses]
    numbers = [(a, b) for a, b in zip(ckpt_losses, plain_losses) if a is not None]
    assert len(numbers) == 3
    assert [a for a, _ in numbers] == pytest.approx([b for _, b in numbers], rel=1e-5)
    for name, tensor in load_file(str(plain / "model.safetensors")).items():
        torch.testing.assert_close(load_file(str(ckpt / "model.safetensors"))[name], tensor, rtol=1e-5, atol=1e-6)


# ---- the public API wrappers ----


def test_public_api_wrappers_are_the_implementations(tmp_path, data):
    from mha2gqa.convert.inspect import inspect_model
    from mha2gqa.eval.run import evaluate
    from mha2gqa.uptrain.recipe import Recipe

    model = tiny_model_dir(tmp_path / "model")
    assert mha2gqa.inspect_model(model) == inspect_model(model)
    info = mha2gqa.inspect_model(model)
    assert (info["heads"], info["kv_heads"]) == (8, 8)
    recipe = mha2gqa.load_recipe(_recipe(tmp_path, model, data), ["seq_len=16"])
    assert isinstance(recipe, Recipe) and recipe.seq_len == 16 and recipe.model == str(model)
    with pytest.raises(mha2gqa.InputError, match="seq_len"):
        mha2gqa.load_recipe(_recipe(tmp_path, model, data), ["seq_len=zero"])
    (tmp_path / "t.txt").write_text(" ".join(["It is a truth universally acknowledged."] * 20))
    kwargs = dict(data=str(tmp_path / "t.txt"), context=32, stride=16, speed_preset="off", progress=False)
    ours, direct = mha2gqa.evaluate(model, **kwargs), evaluate(model, **kwargs)
    assert ours["perplexity"] == direct["perplexity"] and ours["data"] == direct["data"]
    assert ours["model"]["kv_heads"] == 8


# ---- hub paths, mocked (these machines are offline) ----


def test_a_hub_model_id_downloads_safetensors_only_then_converts(tmp_path, monkeypatch):
    import huggingface_hub

    local = tmp_path / "hub-copy"
    save_tiny_model(local, "llama")
    asked = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.update(repo_id=repo_id, allow_patterns=allow_patterns)
        return str(local)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    result = mha2gqa.convert("org/tiny-llama", tmp_path / "gqa", groups=2, progress=False)
    assert asked["repo_id"] == "org/tiny-llama" and result.dst == tmp_path / "gqa"
    assert "*.safetensors" in asked["allow_patterns"] and not any(
        p.endswith((".bin", ".pt", ".pth")) for p in asked["allow_patterns"]
    )
    assert json.loads((tmp_path / "gqa" / "config.json").read_text())["num_key_value_heads"] == 2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match=r"org/tiny-llama is not a local directory and the hub is offline"):
        mha2gqa.convert("org/tiny-llama", tmp_path / "gqa-offline", groups=2, progress=False)


def test_a_hub_dataset_is_read_through_datasets_streaming(monkeypatch):
    import datasets

    from mha2gqa.corpus import textdata

    calls = []

    def fake_load_dataset(name, config=None, split=None, streaming=False, **kwargs):
        calls.append((name, config, split, streaming))
        return [{"text": "first row", "id": 0}, {"text": "second row", "id": 1}, {"text": "third row", "id": 2}]

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    source = textdata.resolve("--data", "org/corpus")
    assert source.hub == "org/corpus"
    assert list(textdata.iter_texts(source, hub_config="en", hub_split="test")) == [
        "first row",
        "second row",
        "third row",
    ]
    assert calls == [("org/corpus", "en", "test", True)]
    with pytest.raises(InputError, match=r"--data org/corpus: has no 'body' column \(columns: text, id\)"):
        list(textdata.iter_texts(source, "body", field_key="--data-column"))
    from mha2gqa.eval.data import read_documents

    docs, identity = read_documents("org/corpus", "en", "test", max_chars=12)
    assert docs == ["first row", "second row"]  # stops once the character budget is met
    assert identity == {"source": "hub", "name": "org/corpus", "config": "en", "split": "test", "column": "text"}


# ---- the copy_file_range fallback ----


def test_plain_copies_give_identical_shards_without_copy_file_range(tmp_path, monkeypatch):
    import mha2gqa.checkpoint as checkpoint

    save_tiny_model(tmp_path / "src", "llama")
    convert = dict(groups=2, max_shard_size="20KB", progress=False)  # several shards, many copied tensors
    mha2gqa.convert(tmp_path / "src", tmp_path / "fast", **convert)

    def refuse(*args):
        raise OSError(18, "Invalid cross-device link")  # EXDEV: what some filesystem pairs answer

    calls = []
    monkeypatch.setattr(checkpoint.os, "copy_file_range", lambda *a: calls.append(a) or refuse(), raising=False)
    mha2gqa.convert(tmp_path / "src", tmp_path / "fallback", **convert)
    assert calls  # the fast path was tried, refused, and the user-space copy took over
    monkeypatch.delattr(checkpoint.os, "copy_file_range")  # and a platform without it at all
    mha2gqa.convert(tmp_path / "src", tmp_path / "none", **convert)
    names = sorted(p.name for p in (tmp_path / "fast").glob("*.safetensors"))
    assert len(names) > 1
    for name in names:
        expected = (tmp_path / "fast" / name).read_bytes()
        assert (tmp_path / "fallback" / name).read_bytes() == expected
        assert (tmp_path / "none" / name).read_bytes() == expected
