"""Loading the model under test (and its reference) for evaluation, and reading its attention shape.

Eval must also measure models the converter refuses (gpt_neox, falcon ...): a parent is worth
measuring even when it cannot be converted, so the shape here is read generically from the config.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mha2gqa.architecture.layouts import AttentionShape, read_config
from mha2gqa.files.loading import prepare_classes
from mha2gqa.files.sources import resolve_model_dir
from mha2gqa.nemotron_nas.blocks import MODEL_TYPE, layer_kv_heads
from mha2gqa.runtime.errors import InputError, first_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise InputError(f"--device {device!r} is not a torch device (use auto, cpu, cuda or cuda:N)") from err


def pick_dtype(dtype: str) -> torch.dtype | str:
    if dtype == "auto":
        return "auto"  # the checkpoint's own dtype: no silent cast
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not supported (use auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def load_model(model_dir: Path, dtype, device: torch.device, progress: bool = True, what: str = "model"):
    """A causal LM in eval mode on `device`: safetensors only, never code shipped with the checkpoint,
    refused when its tensors do not match its config (mha2gqa.files.loading)."""
    from mha2gqa.files.loading import load_causal_lm

    return load_causal_lm(model_dir, what, progress=progress, dtype=dtype).to(device).eval()


def load_config(model_dir: Path):
    """The model's transformers config (no weights), for checks before loading."""
    from transformers import AutoConfig

    # checked first: transformers' errors on a malformed config are tracebacks
    prepare_classes(read_config(model_dir), model_dir)
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError) as err:  # e.g. a model_type this transformers does not know
        first = first_line(err, default=type(err).__name__)
        raise InputError(
            f"{Path(model_dir) / 'config.json'} could not be read by transformers ({first}): "
            "use the model's own config.json, or a newer transformers"
        ) from err


def load_tokenizer(model_dir: Path, tokenizer: str | None = None, what: str = "the tokenizer"):
    """The model dir's tokenizer, or `tokenizer` (a dir or hub id) when given; `what` names it in a refusal."""
    from transformers import AutoTokenizer

    source = resolve_tokenizer_dir(tokenizer) if tokenizer else Path(model_dir)
    if not any((source / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise InputError(f"{source} has no tokenizer files: pass --tokenizer DIR (a directory with tokenizer.json)")
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except Exception as err:  # a tokenizer.json that is not one fails in many types, each a traceback: one line
        raise InputError(
            f"{what} in {source} could not be read by transformers ({first_line(err, 200, default=type(err).__name__)})"
            ": give the model's own tokenizer files, or another with --tokenizer"
        ) from err


def resolve_tokenizer_dir(tokenizer: str) -> Path:
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    # A hub id resolves like a model: a tokenizer repo also carries config.json in practice.
    return resolve_model_dir(tokenizer)


def shape_of(config) -> AttentionShape:
    """Layers, heads, kv heads and head_dim of a loaded transformers config, for any decoder family."""
    heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
    if kv_heads is None and getattr(config, "multi_query", False):
        kv_heads = 1
    kv_heads = int(kv_heads or heads)
    per_layer = tuple(layer_kv_heads(config.to_dict())) if config.model_type == MODEL_TYPE else ()
    hidden = int(config.hidden_size)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    dtype = str(getattr(config, "dtype", None) or "float32").replace("torch.", "")
    return AttentionShape(
        model_type=config.model_type,
        layers=int(config.num_hidden_layers),
        heads=heads,
        kv_heads=max(per_layer) if per_layer else kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        dtype=dtype,
        layer_kv_heads=per_layer,
    )


def validate_vocab(tokenizer, config, name: str) -> None:
    """Token ids the tokenizer can emit must be valid rows of the model's embedding."""
    if len(tokenizer) > int(config.vocab_size):
        raise InputError(
            f"the tokenizer has {len(tokenizer)} tokens but {name} has vocab_size={config.vocab_size}: "
            "pass the model's own tokenizer with --tokenizer"
        )
