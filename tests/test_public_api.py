"""The public API, `mha2gqa.inspect_model`, `load_recipe`, `evaluate` (and `convert`, tests/test_options.py):
thin wrappers that give exactly what the implementations give."""

from __future__ import annotations

import pytest
from uptrain_helpers import corpus, recipe_file, tiny_model_dir

import mha2gqa


def _recipe(tmp_path, model, data):
    data = {"train": str(data), "eval_blocks": 2}
    return recipe_file(tmp_path / "r.yaml", model=str(model), data=data, eval_every=0, output_dir=str(tmp_path / "out"))


def test_public_api_wrappers_are_the_implementations(tmp_path):
    data = corpus(tmp_path / "train.jsonl", docs=80)
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
