"""Uptraining: continue pre-training a (converted) model with accelerate, from a YAML recipe.

`load_recipe(path, overrides)` -> Recipe; `train(recipe, resume=False)` -> the output dir holding the
final HF checkpoint. `train` runs in-process on one process, or on every rank under
`accelerate launch -m mha2gqa.uptrain`.
"""

from __future__ import annotations

from pathlib import Path

from mha2gqa.uptrain.recipe import Recipe
from mha2gqa.uptrain.recipe_load import load_recipe

__all__ = ["Recipe", "load_recipe", "train"]


def train(recipe: Recipe, resume: bool = False) -> Path:
    """Run the recipe (see mha2gqa.uptrain.loop.train)."""
    from mha2gqa.uptrain.loop import train as _train

    return _train(recipe, resume=resume)
