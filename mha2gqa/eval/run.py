"""`evaluate`: everything `mha2gqa eval` measures, in-process, as one result dict.

Every check of the user's input runs before a model is loaded, and the result file is written
only at the end (atomically): a bad flag costs nothing and a failed run leaves no file behind.
"""

from __future__ import annotations

import datetime as dt
import warnings
from pathlib import Path

import torch

from mha2gqa import provenance
from mha2gqa.errors import InputError
from mha2gqa.eval import environment, measurements, speed
from mha2gqa.eval import model as M
from mha2gqa.eval import perplexity as P
from mha2gqa.eval.data import load_eval_text
from mha2gqa.eval.measurements import Loaded, check_all, check_tokenizer, speed_grid
from mha2gqa.eval.options import EvalOptions
from mha2gqa.eval.schema import SCHEMA, write_result
from mha2gqa.sources import require_safetensors, resolve_model_dir

DEFAULT_CONTEXT = 1024


def evaluate(model_path, data=None, reference=None, *, options: EvalOptions | None = None, **kwargs) -> dict:
    """Measure MODEL_PATH (a dir or hub id) and return the result dict; write it to `out` if given.

    The keywords are the fields of EvalOptions (eval/options.py, one docstring each); or pass
    `options=EvalOptions(...)`. data: a text file, a folder of text files, a hub dataset name, "probe"
    (the probe set shipped in the package), "name=path", a list of those or {name: path}: every text is
    a domain, measured apart (perplexity is skipped without data). reference: a parent model to measure KL and top-1 agreement
    against. speed_preset: "auto" (gpu on CUDA, else cpu), "cpu", "gpu", or None/"off" to skip decode
    speed. See `mha2gqa eval --help`; what is measured is the list in eval/measurements.py.
    """
    if options is None:
        options = EvalOptions.from_kwargs({"data": data, "reference": reference, **kwargs})
    elif kwargs or data is not None or reference is not None:
        raise TypeError("evaluate(): pass either options=EvalOptions(...) or data, reference and keywords, not both")
    o = options
    torch.manual_seed(o.seed)
    dev, torch_dtype = M.pick_device(o.device), M.pick_dtype(o.dtype)
    grid = speed_grid(o, dev.type)
    prepared = check_all(o)

    # Everything read from config and tokenizer is checked before any weights are loaded.
    model_dir = resolve_model_dir(model_path)
    ref_dir = resolve_model_dir(o.reference) if o.reference else None
    require_safetensors(model_dir, "model")
    if ref_dir:
        require_safetensors(ref_dir, "--reference")
    prov = provenance.read(model_dir)
    role = environment.infer_role(prov, o.role)
    config = M.load_config(model_dir)
    tok = M.load_tokenizer(model_dir, o.tokenizer)
    M.check_vocab(tok, config, "the model")
    check_tokenizer(o, tok)
    context, stride = _window(config, o.context, o.stride)
    if grid:
        speed.check_grid_fits(grid, getattr(config, "max_position_embeddings", None))
    texts = {name: _text(o, path, tok) for name, path in (o.domains or {}).items()}

    model = M.load_model(model_dir, torch_dtype, dev, o.progress)
    ref_model = M.load_model(ref_dir, torch_dtype, dev, o.progress, "--reference") if ref_dir else None
    shape = M.shape_of(model.config)
    result = _skeleton(model_path, model_dir, model, shape, prov, role, o.label, o.reference, ref_dir, dev, o.seed)
    loaded = Loaded(o, model, ref_model, tok, shape, dev, context, stride, texts, result, prepared)
    for measurement in measurements.MEASUREMENTS:  # looked up now: the registry is the module's list
        if measurement.wanted(o):
            result.update(measurement.measure(loaded))
    for message in result["warnings"]:
        warnings.warn(message, stacklevel=2)
    if o.out:
        write_result(result, Path(o.out))
        _refresh_card(Path(model_dir), Path(o.out))
    return result


def _text(o: EvalOptions, path: str, tok):
    return load_eval_text(
        path, tok, config=o.data_config, split=o.data_split, column=o.data_column, max_tokens=o.max_tokens
    )


def _refresh_card(model_dir: Path, out: Path) -> None:
    """A result saved beside a model whose card mha2gqa wrote goes into that card."""
    from mha2gqa.card import CARD, is_ours, write_card
    from mha2gqa.eval.card_table import measured_cells

    if out.resolve().parent == model_dir.resolve() and is_ours(model_dir / CARD):
        write_card(model_dir, measured=measured_cells(model_dir))


def _window(config, context, stride) -> tuple[int, int]:
    """--context/--stride, defaulted from the model's max positions and checked against them."""
    max_pos = getattr(config, "max_position_embeddings", None)
    context = context or min(DEFAULT_CONTEXT, max_pos or DEFAULT_CONTEXT)
    stride = stride or max(1, context // 2)
    P.check_window(context, stride)
    if max_pos and context > max_pos:
        raise InputError(
            f"--context {context} exceeds the model's max_position_embeddings={max_pos}: use at most {max_pos}"
        )
    return context, stride


def _skeleton(model_path, model_dir, model, shape, prov, role, label, reference, ref_dir, dev, seed) -> dict:
    return {
        "schema": SCHEMA,
        "label": label or Path(str(model_path).rstrip("/")).name,
        "role": role,
        "model": {
            "path": str(model_path),
            "resolved": str(Path(model_dir).resolve()),
            "model_type": shape.model_type,
            "layers": shape.layers,
            "heads": shape.heads,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "hidden": shape.hidden,
            "params": sum(p.numel() for p in model.parameters()),
            "dtype": str(model.dtype).replace("torch.", ""),
            "provenance": prov,
        },
        "reference": {
            "path": str(reference),
            "resolved": str(Path(ref_dir).resolve()),
            "label": Path(str(reference).rstrip("/")).name,
        }
        if reference
        else None,
        "data": None,
        "perplexity": None,
        "agreement": None,
        "domains": None,
        "quality": None,
        "kv_cache": None,
        "speed": None,
        "attention_maps": None,
        "lm_eval": None,
        "warnings": [],
        "env": {
            "device": str(dev),
            "device_name": environment.device_name(dev),
            "versions": environment.versions(),
            "seed": seed,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        },
    }
