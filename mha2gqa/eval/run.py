"""`evaluate`: everything `mha2gqa eval` measures, in-process, as one result dict.

Every check of the user's input runs before a model is loaded, and the result file is written
only at the end (atomically): a bad flag costs nothing and a failed run leaves no file behind.
"""

from __future__ import annotations

import datetime as dt
import warnings
from pathlib import Path

import torch

from mha2gqa import provenance as model_provenance
from mha2gqa.errors import InputError
from mha2gqa.eval import model as M
from mha2gqa.eval import perplexity as P
from mha2gqa.eval import provenance, speed
from mha2gqa.eval.agreement import agreement
from mha2gqa.eval.attention_maps import attention_maps, plot_attention_maps
from mha2gqa.eval.data import load_eval_text
from mha2gqa.eval.kvcache import measure_kv_cache
from mha2gqa.eval.lmeval import check_lm_eval_installed, run_lm_eval, task_manager
from mha2gqa.eval.options import EvalOptions, SpeedPreset
from mha2gqa.eval.schema import SCHEMA, check_writable, write_result
from mha2gqa.sources import require_safetensors, resolve_model_dir

DEFAULT_CONTEXT = 1024


def evaluate(model_path, data=None, reference=None, *, options: EvalOptions | None = None, **kwargs) -> dict:
    """Measure MODEL_PATH (a dir or hub id) and return the result dict; write it to `out` if given.

    The keywords are the fields of EvalOptions (eval/options.py, one docstring each); or pass
    `options=EvalOptions(...)`. data: a text file, a folder of text files, or a hub dataset name
    (perplexity is skipped without it). reference: a parent model to measure KL and top-1 agreement
    against. speed_preset: "auto" (gpu on CUDA, else cpu), "cpu", "gpu", or None/"off" to skip decode
    speed. See `mha2gqa eval --help`.
    """
    if options is None:
        options = EvalOptions.from_kwargs({"data": data, "reference": reference, **kwargs})
    elif kwargs or data is not None or reference is not None:
        raise TypeError("evaluate(): pass either options=EvalOptions(...) or data, reference and keywords, not both")
    o = options
    data, reference, context, stride, out = o.data, o.reference, o.context, o.stride, o.out
    torch.manual_seed(o.seed)
    dev, torch_dtype = M.pick_device(o.device), M.pick_dtype(o.dtype)
    preset = o.speed
    if preset == SpeedPreset.AUTO:
        preset = "gpu" if dev.type == "cuda" else "cpu"
    grid = speed.make_grid(preset, o.speed_batches, o.speed_contexts, o.new_tokens, o.repeats) if preset else None
    _check_inputs(
        data,
        reference,
        context,
        stride,
        o.batch_size,
        o.max_tokens,
        o.kv_batch,
        o.kv_tokens,
        o.role,
        o.attention_text,
        o.attention_png,
        out,
        o.lm_eval_tasks,
        o.lm_eval_limit,
    )
    # Task names are checked (and the task index built) before any weights are loaded.
    tasks = task_manager(o.lm_eval_tasks) if o.lm_eval_tasks else None

    # Everything read from config and tokenizer is checked before any weights are loaded.
    model_dir = resolve_model_dir(model_path)
    ref_dir = resolve_model_dir(reference) if reference else None
    require_safetensors(model_dir, "model")
    if ref_dir:
        require_safetensors(ref_dir, "--reference")
    prov = model_provenance.read(model_dir)
    role = provenance.infer_role(prov, o.role)
    config = M.load_config(model_dir)
    tok = M.load_tokenizer(model_dir, o.tokenizer)
    M.check_vocab(tok, config, "the model")
    context, stride = _window(config, context, stride)
    if grid:
        speed.check_grid_fits(grid, getattr(config, "max_position_embeddings", None))
    text = (
        load_eval_text(
            data, tok, config=o.data_config, split=o.data_split, column=o.data_column, max_tokens=o.max_tokens
        )
        if data
        else None
    )

    model = M.load_model(model_dir, torch_dtype, dev, o.progress)
    ref_model = M.load_model(ref_dir, torch_dtype, dev, o.progress, "--reference") if ref_dir else None
    shape = M.shape_of(model.config)
    result = _skeleton(model_path, model_dir, model, shape, prov, role, o.label, reference, ref_dir, dev, o.seed)
    result["data"] = text.identity if text else None
    if text:
        result.update(_quality(model, ref_model, text.ids, context, stride, o.batch_size, o.progress))
    result["kv_cache"] = measure_kv_cache(model, shape, o.kv_batch, o.kv_tokens, o.seed)
    if "warning" in result["kv_cache"]:
        result["warnings"].append(result["kv_cache"]["warning"])
    if grid:
        result["speed"] = speed.decode_speed(model, grid, o.seed, o.progress)
    if o.attention_text:
        png = Path(o.attention_png) if o.attention_png else Path(out).with_suffix(".attention.png")
        found = attention_maps(model, tok, o.attention_text, o.attention_layer, ref_model)
        labels = {"model": result["label"], "reference": f"{(result['reference'] or {}).get('label', '')} (reference)"}
        result["attention_maps"] = {
            "png": str(plot_attention_maps(found, png, labels, shape.kv_heads)),
            "layer": found["layer"],
        }
    if o.lm_eval_tasks:
        result["lm_eval"] = run_lm_eval(model, tok, o.lm_eval_tasks, o.lm_eval_limit, o.batch_size, tasks)
    for message in result["warnings"]:
        warnings.warn(message, stacklevel=2)
    if out:
        write_result(result, Path(out))
        _refresh_card(Path(model_dir), Path(out))
    return result


def _refresh_card(model_dir: Path, out: Path) -> None:
    """A result saved beside a model whose card mha2gqa wrote goes into that card."""
    from mha2gqa.card import CARD, is_ours, write_card

    if out.resolve().parent == model_dir.resolve() and is_ours(model_dir / CARD):
        write_card(model_dir)


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


def _quality(model, ref_model, ids, context, stride, batch_size, progress) -> dict:
    """Perplexity, and agreement with the reference in the same pass when there is one."""
    if ref_model is None:
        return {"perplexity": P.perplexity(model, ids, context, stride, batch_size, progress)}
    agree, ppl, ref_ppl = agreement(model, ref_model, ids, context, stride, batch_size, progress)
    return {"perplexity": ppl, "agreement": {**agree, "reference_perplexity": ref_ppl["perplexity"]}}


def _check_inputs(
    data,
    reference,
    context,
    stride,
    batch_size,
    max_tokens,
    kv_batch,
    kv_tokens,
    role,
    attention_text,
    attention_png,
    out,
    lm_eval_tasks,
    lm_eval_limit=None,
) -> None:
    """Everything that can be refused before a model is loaded."""
    if reference and not data:
        raise InputError("--reference needs --data: agreement is measured on the same text")
    if context is not None:
        P.check_window(context, stride or max(1, context // 2))
    for flag, value, low in (
        ("--batch-size", batch_size, 1),
        ("--max-tokens", max_tokens, 2),
        ("--kv-batch", kv_batch, 1),
        ("--kv-tokens", kv_tokens, 1),
    ):
        if value is not None and value < low:
            raise InputError(f"{flag} {value} must be at least {low}")
    if role is not None:
        provenance.infer_role(None, role)
    if attention_text and not (attention_png or out):
        raise InputError("--attention-maps needs --out or --attention-png to know where to save the PNG")
    if out and Path(out).is_dir():
        raise InputError(f"--out {out} is a directory: pass a file path such as {Path(out) / 'results.json'}")
    for flag, path in (("--out", out), ("--attention-png", attention_png)):
        if path:  # a read-only or full destination fails now, not after the whole evaluation
            check_writable(Path(path), flag)
    if lm_eval_tasks:
        check_lm_eval_installed()
    if lm_eval_limit is not None and lm_eval_limit < 1:
        raise InputError(f"--lm-eval-limit {lm_eval_limit} must be at least 1 (or left out for every example)")


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
        "kv_cache": None,
        "speed": None,
        "attention_maps": None,
        "lm_eval": None,
        "warnings": [],
        "env": {
            "device": str(dev),
            "device_name": provenance.device_name(dev),
            "versions": provenance.versions(),
            "seed": seed,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        },
    }
