"""Shared pieces of the uptrain tests: a tiny model with its tokenizer, a corpus, a recipe file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_model


def tiny_model_dir(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random llama (vocab 128) with a tokenizer whose ids fit it."""
    save_tiny_model(path, "llama", seed=seed, **overrides)
    make_tiny_tokenizer(path)
    return path


def corpus(path: Path, docs: int = 120, seed: int = 0) -> Path:
    """`docs` distinct pseudo-sentences as jsonl (distinct so that block hashes do not collide)."""
    rng = random.Random(seed)
    words = SAMPLE_TEXT.split()
    with path.open("w") as f:
        for i in range(docs):
            text = f"doc {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(20, 120)))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def recipe_file(path: Path, **keys) -> Path:
    """A recipe for a tiny fast run; keys override (sections as dicts)."""
    base = {
        "seq_len": 32,
        "micro_batch_size": 4,
        "grad_accum": 1,
        "log_every": 2,
        "eval_every": 4,
        "save_every": 0,
        "tensorboard": False,
        "optim": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.0},
        "budget": {"max_steps": 8},
        "data": {"eval_blocks": 8},
    }
    for key, value in keys.items():
        if isinstance(value, dict):
            base[key] = {**base.get(key, {}), **value}
        else:
            base[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(base))
    return path


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
