"""`evaluate`: everything `mha2gqa eval` measures, in-process, as one result dict.

Every check of the user's input runs before a model is loaded, and the result file is written
only at the end (atomically): a bad flag costs nothing and a failed run leaves no file behind.
"""

from __future__ import annotations

import datetime as dt
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.corpus.tokens import stream_ids
from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.eval import environment, measurements, speed
from mha2gqa.eval import model as M
from mha2gqa.eval.data import load_eval_text, validate_text_ids
from mha2gqa.eval.measurements import Loaded, retrieval_grid, speed_grid, validate_all, validate_tokenizer
from mha2gqa.eval.options import EvalOptions
from mha2gqa.eval.reference_tops import TopReference, score_tops
from mha2gqa.eval.schema import SCHEMA, write_result
from mha2gqa.files.sources import require_safetensors, resolve_model_dir
from mha2gqa.records import provenance
from mha2gqa.runtime.errors import InputError, WeightWarning
from mha2gqa.scoring import perplexity as P
from mha2gqa.scoring.retrieval_heads import MAX_LENGTH as HEADS_MAX_LENGTH

DEFAULT_CONTEXT = 1024


def evaluate(
    model_path, data=None, reference=None, *, options: EvalOptions | None = None, clock=NO_CLOCK, **kwargs
) -> dict:
    """Measure MODEL_PATH (a dir or hub id) and return the result dict; write it to `out` if given.

    The keywords are the fields of EvalOptions (eval/options.py, one docstring each); or pass
    `options=EvalOptions(...)`. data: a text file, a folder of text files, a hub dataset name, "probe"
    (the probe set shipped in the package), "name=path", a list of those or {name: path}: every text is
    a domain, measured apart (perplexity is skipped without data). reference: a parent model to measure KL and top-1 agreement
    against. speed_preset: "auto" (gpu on CUDA, else cpu), "cpu", "gpu", or None/"off" to skip decode
    speed. See `mha2gqa eval --help`; what is measured is the list in eval/measurements.py. clock: an
    estimates Clock that says the estimate before any weights are loaded and times each stage (the CLI's).
    """
    if options is None:
        options = EvalOptions.from_kwargs({"data": data, "reference": reference, **kwargs})
    elif kwargs or data is not None or reference is not None:
        raise TypeError("evaluate(): pass either options=EvalOptions(...) or data, reference and keywords, not both")
    o = options
    torch.manual_seed(o.seed)
    found = _inputs(model_path, o)
    if isinstance(o.reference, TopReference) and found.texts and found.reference_tops is None:  # alone in memory
        bar = o.progress and Path(str(o.reference)).name
        found.reference_tops = score_tops(
            o.reference, found.texts, found.context, found.stride, found.dtype, found.device, bar
        )
    model = M.load_model(found.model_dir, found.dtype, found.device, o.progress)
    ref_model = None  # a TopReference: loaded when its numbers are scored (above) or retrieval asks it (Loaded)
    if found.ref_dir and not isinstance(o.reference, TopReference):
        ref_model = M.load_model(found.ref_dir, found.dtype, found.device, o.progress, "--reference")
    clock.begin(lambda: eval_estimate(found, o))  # once the weights are checked: a refusal stays one line
    shape = M.shape_of(model.config)
    result = _skeleton(model_path, found.model_dir, model, shape, found.prov, found.role, o.label, found.device, o.seed)
    result["reference"] = _reference(o.reference, found.ref_dir, ref_model)
    loaded = Loaded(
        o, model, ref_model, found.tokenizer, shape, found.device, found.context, found.stride, found.texts, result,
        found.prepared, clock, found.dtype, found.reference_tops,
    )  # fmt: skip
    for measurement in measurements.MEASUREMENTS:  # looked up now: the registry is the module's list
        if measurement.wanted(o):
            if measurement.key != "quality":  # quality marks each domain's stage itself
                clock.stage(measurement.stage)
            result.update(measurement.measure(loaded))
    for message in result["warnings"]:  # the CLI shows each as one `Warning:` line (cli/__init__.py)
        warnings.warn(message, WeightWarning, stacklevel=2)
    if o.out:
        write_result(result, Path(o.out))
        _refresh_card(Path(found.model_dir), Path(o.out))
    clock.finish()
    return result


@dataclass
class _Inputs:
    """What an evaluation reads, checked before any weights are loaded."""

    model_dir: Path
    ref_dir: Path | None
    prov: dict | None
    role: str
    config: object
    tokenizer: object
    context: int
    stride: int
    grid: object  # speed.SpeedGrid or None
    texts: dict
    device: torch.device
    dtype: object
    prepared: dict
    reference_tops: dict | None = None  # a TopReference's numbers on the texts, when it knew them


def _inputs(model_path, o: EvalOptions) -> _Inputs:
    """Every check of the options, the model's config and tokenizer, and the texts tokenized: before the
    estimate, and before any weights are loaded."""
    dev, torch_dtype = M.pick_device(o.device), M.pick_dtype(o.dtype)
    grid = speed_grid(o, dev.type)
    prepared = validate_all(o)
    model_dir = resolve_model_dir(model_path)
    ref_dir = resolve_model_dir(str(o.reference)) if o.reference else None  # a TopReference: its folder
    require_safetensors(model_dir, "model")
    if ref_dir:
        require_safetensors(ref_dir, "--reference")
    prov = provenance.read(model_dir)
    role = environment.infer_role(prov, o.role)
    config = M.load_config(model_dir)
    tok = _tokenizer(model_dir, o)
    validate_tokenizer(o, tok)
    context, stride = _window(config, o.context, o.stride)
    if grid:
        speed.validate_grid_fits(grid, getattr(config, "max_position_embeddings", None))
    texts = read_texts(o, tok)
    for name, text in texts.items():  # the ids a forward would embed, before any weights are loaded
        validate_text_ids(text.ids, int(config.vocab_size), name, _tokenizer_words(o))
    M.validate_vocab(tok, config, "the model")
    if o.retrieval:  # its lengths within the model's positions, and its questions within its lengths
        from mha2gqa.scoring.retrieval_items import build_items

        build_items(tok, retrieval_grid(o, config))
    known = None
    if isinstance(o.reference, TopReference):  # its numbers when it knows them (convert's check: its cache)
        known = o.reference.known({n: t.ids for n, t in texts.items()}, context, stride, int(config.vocab_size))
    return _Inputs(
        model_dir, ref_dir, prov, role, config, tok, context, stride, grid, texts, dev, torch_dtype, prepared, known
    )


def _tokenizer_words(o: EvalOptions) -> str:
    """The tokenizer that reads the texts, in a refusal's words."""
    if o.tokenizer is None and isinstance(o.reference, TopReference):
        return f"{o.reference.name}'s tokenizer"
    return "the tokenizer"


def _tokenizer(model_dir: Path, o: EvalOptions):
    """--tokenizer's, else a reference known by its top tokens lends its own (its numbers are positions of the ids
    it gives), else the model's."""
    source = o.tokenizer
    if source is None and isinstance(o.reference, TopReference):
        source = str(o.reference.path)
    return M.load_tokenizer(model_dir, source, _tokenizer_words(o))


def eval_estimate(found: _Inputs, o: EvalOptions):
    """The run's estimate: each stage's work from the weights' headers, the texts' windows and the speed grid,
    scaled to this machine by a probe when it is long enough (for_this_machine); its peak memory from the weights and a batch of windows."""
    from mha2gqa.estimates import STORED, Estimate, EvalWork, eval_peak_bytes, eval_stages, for_this_machine
    from mha2gqa.eval.batching import window_bytes
    from mha2gqa.files.checkpoint import SafetensorsCheckpoint

    def size(folder):
        checkpoint = SafetensorsCheckpoint(folder)
        return sum(math.prod(t.shape) for t in checkpoint.tensors.values()), sum(
            t.nbytes for t in checkpoint.tensors.values()
        )

    (params, weights), (ref_params, ref_weights) = (
        size(found.model_dir),
        size(found.ref_dir) if found.ref_dir else (None, 0),
    )
    windows = {name: P.windows(text.ids.numel(), found.context, found.stride) for name, text in found.texts.items()}
    texts = {name: (sum(w.end - w.start for w in wins), sum(w.scored for w in wins)) for name, wins in windows.items()}
    points = (
        len(found.grid.batches) * len(found.grid.contexts) * (2 if o.speed_side_by_side else 1) if found.grid else 0
    )
    examples = o.lm_eval_limit * len(o.lm_eval_tasks) if o.lm_eval_tasks and o.lm_eval_limit else None
    probe = retrieval_grid(o, found.config) if o.retrieval else None
    retrieval = (probe.forward_tokens(), probe.tokens_up_to(HEADS_MAX_LENGTH)) if probe else (0, 0)
    attention = stream_ids(o.attention_text, found.tokenizer).numel() if o.attention_text else 0
    sizes = (params, ref_params, found.config.vocab_size, weights + ref_weights)
    work = EvalWork(*sizes, texts, points, examples, *retrieval, attention_tokens=attention)
    element = max(1, weights // max(params, 1))
    batch = 1 if o.batch_size == "auto" else o.batch_size
    peak = eval_peak_bytes(work, window_bytes(found.config, found.context, element), batch)
    peak += _heads_maps_bytes(found.config, probe, element) if probe else 0
    return for_this_machine(Estimate(tuple(eval_stages(work)), STORED, peak), "torch")


def _heads_maps_bytes(config, probe, element: int) -> int:
    """The attention maps of every layer that the retrieval heads' scores hold at once (scoring/retrieval_heads.py)."""
    held = max([n for n in probe.lengths if n <= HEADS_MAX_LENGTH], default=0)
    return config.num_hidden_layers * config.num_attention_heads * held * held * element


def read_texts(o: EvalOptions, tok) -> dict:
    """{domain: EvalText} of --data, each read and tokenized by `tok` (eval/data.py), cut to --max-tokens."""
    return {
        name: load_eval_text(
            path, tok, config=o.data_config, split=o.data_split, column=o.data_column, max_tokens=o.max_tokens
        )
        for name, path in (o.domains or {}).items()
    }


def _refresh_card(model_dir: Path, out: Path) -> None:
    """A result saved beside a model whose card mha2gqa wrote goes into that card."""
    from mha2gqa.eval.card_table import measured_cells
    from mha2gqa.records.card import CARD, is_ours, write_card

    if out.resolve().parent == model_dir.resolve() and is_ours(model_dir / CARD):
        write_card(model_dir, measured=measured_cells(model_dir))


def _window(config, context, stride) -> tuple[int, int]:
    """--context/--stride, defaulted from the model's max positions and checked against them."""
    max_pos = getattr(config, "max_position_embeddings", None)
    context = context or min(DEFAULT_CONTEXT, max_pos or DEFAULT_CONTEXT)
    stride = stride or context  # windows side by side: every token computed once (docs/eval.md, "Cost")
    P.validate_window(context, stride)
    if max_pos and context > max_pos:
        raise InputError(
            f"--context {context} exceeds the model's max_position_embeddings={max_pos}: use at most {max_pos}"
        )
    return context, stride


def _reference(reference, ref_dir, ref_model) -> dict | None:
    """Which model --reference was, and its shape: a report of this one result compares with it
    (eval/reference_result.py), its KV bytes per token by formula."""
    if not reference:
        return None
    if ref_model is None:  # known by its top tokens (eval/reference_tops.py), not loaded
        return {"path": str(reference), "resolved": str(Path(ref_dir).resolve()), "label": Path(str(reference)).name,
                "top_k": reference.top_k}  # fmt: skip
    shape = M.shape_of(ref_model.config)
    return {
        **_model_facts(reference, ref_dir, ref_model, shape),
        "label": Path(str(reference).rstrip("/")).name,
        "kv_formula_bytes_per_token": shape.kv_bytes_per_token(dtype_bytes=ref_model.dtype.itemsize),
    }


def _model_facts(path, model_dir, model, shape) -> dict:
    """Where a model is and its attention's shape, size and dtype: the evaluated model's and the reference's."""
    return {
        "path": str(path),
        "resolved": str(Path(model_dir).resolve()),
        "layers": shape.layers,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        **({"kv_heads_per_layer": list(shape.layer_kv_heads)} if shape.layer_kv_heads else {}),
        "head_dim": shape.head_dim,
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype).replace("torch.", ""),
    }


def _skeleton(model_path, model_dir, model, shape, prov, role, label, dev, seed) -> dict:
    return {
        "schema": SCHEMA,
        "label": label or Path(str(model_path).rstrip("/")).name,
        "role": role,
        "model": {
            **_model_facts(model_path, model_dir, model, shape),
            "model_type": shape.model_type,
            "hidden": shape.hidden,
            "provenance": prov,
        },
        "reference": None,
        "data": None,
        "perplexity": None,
        "agreement": None,
        "domains": None,
        "quality": None,
        "retrieval": None,
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
