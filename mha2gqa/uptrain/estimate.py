"""An uptraining run's estimate, said before the models are loaded: its work (mha2gqa.estimates' UptrainWork)
from the recipe, the models' sizes and the data's, and its peak memory."""

from __future__ import annotations

import math
from pathlib import Path

from mha2gqa import estimates
from mha2gqa.corpus.mix import part_tokens
from mha2gqa.uptrain.data import sources
from mha2gqa.uptrain.recipe import Recipe
from mha2gqa.uptrain.steps import tokens_per_step, total_steps


def model_size(source: str | None, tokenizer_vocab: int | None = None) -> tuple[int, int, int]:
    """(parameters, bytes as loaded, vocabulary) of a model directory (its safetensors headers) or of a config
    (a model built on the meta device: nothing allocated); (0, 0, 0) when it is neither."""
    from mha2gqa.checkpoint import SafetensorsCheckpoint
    from mha2gqa.layouts import read_config

    path = Path(str(source)).expanduser() if source else None
    if path is None or not path.exists():
        return 0, 0, 0
    if path.is_dir() and any(path.glob("*.safetensors")):
        tensors = SafetensorsCheckpoint(path).tensors.values()
        vocab = read_config(path).get("vocab_size") or 0
        return sum(math.prod(t.shape) for t in tensors), sum(t.nbytes for t in tensors), vocab
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(read_config_file(path if path.is_file() else path / "config.json"))
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return parameters, 4 * parameters, getattr(config, "vocab_size", tokenizer_vocab or 0)


def read_config_file(path: Path) -> dict:
    from mha2gqa.reading import read_json

    return read_json(path, "pass a model's config.json")


def trained_parameters(recipe: Recipe, student: str | None, parameters: int) -> int:
    """What the run trains: every parameter, the attention's (q, k, v, o of every layer) or its keys' and
    values'; LoRA's adapters are counted as none (a few per cent)."""
    if recipe.trainable == "all" or not student:
        return parameters
    from mha2gqa.layouts import attention_shape, read_config

    path = Path(student).expanduser()
    shape = attention_shape(read_config(path) if path.is_dir() else read_config_file(path))
    kv = 2 * shape.hidden * shape.kv_heads * shape.head_dim
    per_layer = {"attention": estimates.attention_parameters(shape), "kv": kv}.get(recipe.trainable, 0)
    return shape.layers * per_layer


def eval_count(recipe: Recipe, steps: int) -> int:
    """Evals a run makes: at the start (eval_at_start), every eval_every steps, and at the last step."""
    every = recipe.eval_every or steps
    return int(recipe.eval_at_start) + steps // every + (1 if steps % every else 0)


def uptrain_estimate(recipe: Recipe, world_size: int, machine) -> estimates.Estimate:
    """The run's stages (start, train, save) on `machine`, and its peak memory."""
    steps = total_steps(recipe, world_size)
    tokens = steps * tokens_per_step(recipe, world_size)
    student = recipe.model or recipe.init_from_config
    params, weights, vocab = model_size(student)
    teacher, teacher_bytes, _ = model_size(recipe.distill.teacher) if recipe.distill.teacher else (None, 0, 0)
    sampled, text = _data_tokens(recipe, tokens // max(world_size, 1))
    work = estimates.UptrainWork(
        params,
        teacher or None,
        weights + teacher_bytes,
        tokens // max(world_size, 1),  # one process's share: the ranks run at once
        eval_count(recipe, steps),
        recipe.data.eval_blocks * recipe.seq_len,
        sampled,
        text,
        bool(recipe.gradient_checkpointing),
        trained_parameters(recipe, student, params),
    )
    peak = estimates.uptrain_peak_bytes(work, work.trained, recipe.micro_batch_size * recipe.seq_len, vocab)
    return estimates.Estimate(tuple(estimates.uptrain_stages(work)), machine, peak)


def _data_tokens(recipe: Recipe, tokens: int) -> tuple[int, int]:
    """(tokens sampled from the teacher, tokens of text tokenized) for one process's share of the run."""
    parts, _ = sources(recipe.data)
    shares = [part.share for part in parts] if len(parts) > 1 else [1.0]
    split = part_tokens(shares, tokens, recipe.seq_len) if len(parts) > 1 else [tokens]
    sampled = sum(n for part, n in zip(parts, split) if part.sampled)
    if sampled:
        sampled += recipe.data.eval_blocks * recipe.seq_len if recipe.data.eval is None else 0
    text = 0
    for part in parts:
        if not part.sampled and part.text.hub is None:
            text += estimates.text_tokens([str(f) for f in part.text.files]) or 0
    return sampled, text
