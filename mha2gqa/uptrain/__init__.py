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


def train(recipe: Recipe, resume: bool = False, clock=None) -> Path:
    """Run the recipe (see mha2gqa.uptrain.loop.train); clock: an estimates Clock that says the run's estimate and
    times it (the CLI's), None for none."""
    from mha2gqa.uptrain.loop import train as _train

    return _train(recipe, resume=resume) if clock is None else _train(recipe, resume=resume, clock=clock)
