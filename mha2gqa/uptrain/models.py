"""Loading what a recipe trains: tokenizer, student (pretrained or from a config), teacher; choosing
the trainable parameters; building AdamW."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.architecture.layouts import read_config
from mha2gqa.files.loading import load_causal_lm, prepare_classes
from mha2gqa.files.sources import resolve_model_dir
from mha2gqa.runtime.errors import InputError, first_line
from mha2gqa.uptrain import lora
from mha2gqa.uptrain.preflight import disk_needed, validate_same_vocabulary
from mha2gqa.uptrain.recipe import Recipe
from mha2gqa.uptrain.trainable import patterns as trainable_patterns


@dataclass
class Student:
    model: torch.nn.Module
    source_dir: Path | None
    """The pretrained model's directory (None when initialised from a config)."""
    saved_dtype: torch.dtype
    """The dtype the source checkpoint was stored in: the final checkpoint is written in it too."""


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    if not Path(source).expanduser().is_dir():
        # Fetched (or refused) through the one hub rule, so a mistyped local path or an unreachable hub
        # is answered by name and at once, not after transformers' own retries of every tokenizer file.
        source = resolve_model_dir(source)
    if (Path(source) / "config.json").is_file():  # a model class of mha2gqa's own registered first: its config
        prepare_classes(read_config(source), source)  # is read by the tokenizer too, and warned of unregistered
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:  # transformers' message runs to several lines: keep its first
        first = first_line(err, default=type(err).__name__)
        raise InputError(
            f"tokenizer {source} could not be loaded ({first}): set tokenizer=<dir with tokenizer files>"
        ) from err


def load_student(recipe: Recipe) -> Student:
    from transformers import AutoConfig, AutoModelForCausalLM

    # Master weights are fp32 whatever the checkpoint holds; autocast provides bf16/fp16 compute.
    kwargs = dict(dtype=torch.float32, attn_implementation=recipe.attn_implementation, **lora.load_kwargs(recipe))
    if recipe.model is not None:
        source = resolve_model_dir(recipe.model)
        config = read_config(source)
        stored = getattr(torch, str(config.get("dtype") or config.get("torch_dtype")).replace("torch.", ""), None)
        if recipe.trainable == "lora" and isinstance(stored, torch.dtype) and "quantization_config" not in kwargs:
            # A frozen base needs no fp32 master copy: held as stored (a bf16 7B takes 13.5 GB, not 27),
            # bit for bit what is on disk; the adapters stay fp32 (peft's autocast_adapter_dtype).
            kwargs["dtype"] = stored
        try:
            model = load_causal_lm(source, "model", **kwargs)
        except InputError:
            raise
        except (ImportError, ValueError) as err:  # e.g. an attention kernel that is not installed
            raise InputError(
                f"model={recipe.model} could not be loaded with attn_implementation="
                f"{recipe.attn_implementation} ({err})"
            ) from err
        return Student(model, source, stored if isinstance(stored, torch.dtype) else torch.float32)
    try:
        config = AutoConfig.from_pretrained(recipe.init_from_config)
    except (OSError, ValueError) as err:
        raise InputError(f"init_from_config={recipe.init_from_config} is not a usable model config ({err})") from err
    torch.manual_seed(recipe.seed)  # the initial weights are part of what the seed reproduces
    return Student(AutoModelForCausalLM.from_config(config, **kwargs), None, torch.float32)


def load_teacher(recipe: Recipe, device: torch.device) -> torch.nn.Module:
    """The frozen MHA parent, in the autocast dtype to halve its memory under bf16/fp16."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.mixed_precision, torch.float32)
    source = resolve_model_dir(recipe.distill.teacher)
    teacher = load_causal_lm(source, "distill.teacher", dtype=dtype, attn_implementation=recipe.attn_implementation)
    return teacher.to(device).eval().requires_grad_(False)


def validate_teacher(student: torch.nn.Module, teacher: torch.nn.Module) -> None:
    """KL compares whole next-token distributions: both models need the same vocabulary (preflight's rule, which
    `uptrain --dry-run` applies to the configs)."""
    validate_same_vocabulary(student.config.vocab_size, teacher.config.vocab_size)


def validate_vocab(model: torch.nn.Module, blocks: torch.Tensor, what: str = "model") -> None:
    vocab = model.config.vocab_size
    if len(blocks) and int(blocks.max()) >= vocab:
        raise InputError(
            f"the tokenizer produces id {int(blocks.max())} but the {what} has vocab_size={vocab}: "
            "use the model's own tokenizer (tokenizer=...)"
        )


def select_trainable(model: torch.nn.Module, mode: str) -> int:
    """Freeze everything outside `mode`; returns the number of trainable parameters (for lora, peft
    has already frozen all but the adapters)."""
    if mode not in ("all", "lora"):
        patterns = trainable_patterns(model.config.to_dict(), mode)
        for name, param in model.named_parameters():
            param.requires_grad_(any(p.match(name) for p in patterns))
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if count == 0:
        raise InputError(f"trainable={mode} matches no parameter of this {model.config.model_type} model")
    return count


def make_optimizer(model: torch.nn.Module, optim, device_type: str) -> torch.optim.Optimizer:
    """AdamW, fused where the device has it; no weight decay on vectors (norms, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    # The fused kernel is several times faster on CPU too (one pass over all tensors).
    fused = device_type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, fused=fused)


def validate_positions(model: torch.nn.Module, seq_len: int) -> None:
    """Blocks longer than the model's positions train on positions it never saw (or index past a
    learned position table): refuse rather than train silently."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and seq_len > limit:
        raise InputError(
            f"seq_len={seq_len} exceeds the model's max_position_embeddings={limit}: use seq_len={limit} or less"
        )


def save_bytes(model: torch.nn.Module, saved_dtype: torch.dtype, checkpoints: bool) -> int:
    """Disk a run needs at least: one resumable checkpoint (fp32 weights + AdamW's two fp32 moments of
    the trainable ones) when it saves any, and the final model in its saved dtype."""
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return disk_needed(params, trainable, saved_dtype.itemsize, checkpoints)
