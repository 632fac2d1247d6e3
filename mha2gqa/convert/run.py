"""`convert`: check the request, plan, then stream tensors from SRC into a new DST atomically.

Two executors run the plan: fast.py (numpy, no torch imported) for the plain methods where its output
is byte-identical, and the torch one below for everything else. The checks and the plan are shared,
and this module imports torch only inside the torch executor and the calibration/refine branches.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mha2gqa import provenance
from mha2gqa.card import write_card
from mha2gqa.checkpoint import INDEX_NAME, SafetensorsCheckpoint, ShardedWriter, atomic_directory, check_destination
from mha2gqa.convert import fast
from mha2gqa.convert.options import DEFAULT_CALIBRATION_TOKENS, ConvertOptions, Grouping  # noqa: F401 (re-exported)
from mha2gqa.convert.plan import Plan, make_plan
from mha2gqa.convert.roles import pack, unpack
from mha2gqa.convert.rope import check_refine_layout
from mha2gqa.errors import InputError
from mha2gqa.layouts import attention_shape, check_groups, check_target, converted_config, layout_for, read_config
from mha2gqa.progress import progress_bar
from mha2gqa.sources import PICKLE_SUFFIXES, resolve_model_dir

OUT_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # --dtype -> safetensors code
_NOT_COPIED = {"config.json", INDEX_NAME, provenance.FILE_NAME}


@dataclass
class ConversionResult:
    plan: Plan
    dst: Path | None  # None for a dry run
    source: Path
    # Per layer (with calibration or grouping): key_error, value_error, kv_order.
    layers: list[dict] = field(default_factory=list)
    refine: dict | None = None  # with refine: options, token counts and per-layer output errors


def parse_size(text: str | int, flag: str = "--max-shard-size") -> int:
    """'5GB' (10^9), '500MiB' (2^20) or plain bytes, as transformers reads --max-shard-size.
    `flag` is the option the size came from, for the message."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise InputError(f"{flag} {text!r} is not a size: use e.g. 5GB, 500MB or 2GiB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    if number * scale < 1:
        raise InputError(f"{flag} {text!r} must be positive")
    return int(number * scale)


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    src_r, dst_r = src.resolve(), dst.resolve()
    if dst_r == src_r or src_r in dst_r.parents:
        raise InputError(f"DST {dst} is inside SRC {src}: choose a directory outside the source model")
    if dst_r in src_r.parents:
        raise InputError(f"DST {dst} contains SRC {src}: replacing it would delete the source; choose another DST")
    check_destination(dst, force)


def _bytes_needed(source: Path, plan: Plan) -> int:
    """What DST will hold: the planned tensors, the files copied beside them, 1 MiB for headers and JSON."""
    copied = sum(
        path.stat().st_size
        for path in source.iterdir()
        if path.is_file() and path.suffix not in (".safetensors", *PICKLE_SUFFIXES)
    )
    return plan.bytes_out + copied + (1 << 20)


def _check_not_quantized(src: Path, config: dict) -> None:
    """GPTQ/AWQ/bitsandbytes/fp8 checkpoints store packed integers and scales: averaging them is not
    averaging the weights they stand for."""
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise InputError(
            f"{src} is quantized (quantization_config quant_method={method}): mha2gqa merges "
            "unquantized weights; dequantize it first (e.g. load it with transformers and "
            "save_pretrained in bfloat16) and convert that"
        )


def _check_weights(src: Path) -> None:
    has_safetensors = any(src.glob("*.safetensors"))
    pickles = [p.name for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles and not has_safetensors:
        raise InputError(
            f"{src} has only pickled weights ({', '.join(sorted(pickles)[:3])}): mha2gqa never unpickles files; "
            're-save them as safetensors first: python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{src}').save_pretrained('{src}-safetensors')\""
        )


def convert(src, dst, groups: int | None = None, options: ConvertOptions | None = None, **kwargs) -> ConversionResult:
    """Convert the model at `src` (directory or hub id) to `groups` kv heads, written to `dst`.
    The keywords are the fields of ConvertOptions (convert/options.py, one docstring each); or pass
    `options=ConvertOptions(...)`. With `calibration` (files, folders or a hub dataset: see mha2gqa.textdata),
    per-layer statistics of the attention input are gathered first (calibrated merge, similarity grouping,
    reconstruction errors); a sweep can pass statistics it gathered once with calibration.calibrate instead.
    With `refine`, the merged model is then refined layer by layer against the parent on the calibration
    tokens (convert/refine.py)."""
    if options is None:
        options = ConvertOptions.from_kwargs(groups, kwargs)
    elif kwargs or groups is not None:
        raise TypeError("convert(): pass either options=ConvertOptions(...) or groups and keywords, not both")
    groups, method, seed, dtype = options.groups, options.method, options.seed, options.dtype
    force, progress, calibration = options.force, options.progress, options.calibration
    calibration_tokens, grouping, refine = options.calibration_tokens, options.grouping, options.refine
    if dtype is not None and dtype not in OUT_DTYPES:
        raise InputError(f"--dtype {dtype!r} is unknown (valid: {', '.join(OUT_DTYPES)})")
    shard_bytes = parse_size(options.max_shard_size)
    source = resolve_model_dir(src)
    config = read_config(source)
    layout, shape = layout_for(config), attention_shape(config)
    check_groups(shape, groups)
    check_target(config, groups)
    torch_reason = fast.request_refusal(options, config)  # None: a plain request, done without torch
    rewrites = False
    if torch_reason:  # a plain request (mean/first, no calibration, contiguous) has nothing for these to refuse
        from mha2gqa.convert.layer_step import check_request
        from mha2gqa.convert.methods import METHODS

        check_request(config, method, METHODS[method], calibration, grouping)
        rewrites = METHODS[method].rewrites_query_output
    if refine is not None:
        from mha2gqa.convert.refine import check_refine

        check_refine(refine, calibration, config, calibration_tokens)
        check_refine_layout(config)
    memory_bytes = parse_size(options.calibration_memory, "--calibration-memory")
    dst = Path(dst).expanduser()
    _check_destination(source, dst, force)
    _check_weights(source)
    _check_not_quantized(source, config)
    provenance.lineage(source)  # a broken SRC/mha2gqa.json fails now, not after every tensor is written
    checkpoint = SafetensorsCheckpoint(source)
    plan = make_plan(
        checkpoint.tensors,
        layout,
        shape,
        groups,
        method.value,
        OUT_DTYPES.get(dtype),
        route_query_output=rewrites or grouping != Grouping.CONTIGUOUS,
    )
    if options.dry_run:
        return ConversionResult(plan, None, source)
    torch_reason = torch_reason or fast.plan_refusal(plan, checkpoint.tensors)
    # Claimed, checked for room and cleared of debris before calibration, the long part, starts. The
    # statistics ((d+1)^2 float64 per layer: GBs for a 7B) live inside the partial directory, so they
    # count against DST's room, not a small /tmp, and a killed run's are removed with its debris.
    gathering = calibration is not None and not _is_stats(calibration)
    stats_bytes = shape.layers * (shape.hidden + 1) ** 2 * 8 if gathering else 0
    with (
        atomic_directory(dst, replace=force, needed_bytes=_bytes_needed(source, plan) + stats_bytes) as tmp,
        tempfile.TemporaryDirectory(prefix=".calibration-", dir=tmp) as stats_dir,
    ):
        layers, stats = [], None
        if torch_reason is None:
            fast.write_tensors(checkpoint, plan, tmp, shard_bytes, progress)
        else:
            from mha2gqa.convert.calibration import calibrate

            stats = (
                calibration
                if _is_stats(calibration) or calibration is None
                else calibrate(
                    source, layout, shape, calibration, calibration_tokens, Path(stats_dir), memory_bytes, progress
                )
            )
            layers = _write_tensors(checkpoint, plan, tmp, shard_bytes, seed, progress, stats, grouping)
        _copy_other_files(source, tmp)
        _write_config(config, groups, dtype, tmp)
        refined = None
        if refine is not None:
            from mha2gqa.convert.refine import calibration_token_ids, refine_checkpoint

            ids = calibration_token_ids(source, calibration, calibration_tokens)
            refined = refine_checkpoint(source, tmp, layout, shape, ids, refine, progress)
        extra = {
            "grouping": grouping.value,
            "calibration": stats.record if stats else None,
            "layers": layers,
            "refine": refined,
        }
        _write_provenance(source, config, plan, seed, dtype, tmp, extra)
        write_card(tmp, source, dst.name)  # README.md from mha2gqa.json; a copied source card moves to SOURCE_README.md
    return ConversionResult(plan, dst, source, layers, refined)


def _is_stats(calibration) -> bool:
    """Statistics a sweep gathered once (calibration.CalibrationStats), not data to gather them from."""
    if calibration is None or isinstance(calibration, (str, list, tuple, Path)):
        return False
    from mha2gqa.convert.calibration import CalibrationStats

    return isinstance(calibration, CalibrationStats)


def _write_tensors(
    checkpoint,
    plan: Plan,
    out_dir: Path,
    shard_bytes: int,
    seed: int,
    progress: bool,
    stats=None,
    grouping: Grouping = Grouping.CONTIGUOUS,
) -> list[dict]:
    """The torch executor: every method, grouping and layout."""
    from mha2gqa.checkpoint import DTYPES
    from mha2gqa.convert.methods import METHODS

    writer = ShardedWriter(out_dir, plan.output_tensors(), shard_bytes, plan.copies(checkpoint.tensors))
    method = METHODS[plan.method]
    bar = progress_bar(plan.bytes_out, "convert", progress, unit="B", unit_scale=True)
    layers = []
    for step in plan.steps:
        if not step.is_transform:
            out, info = step.outputs[0], checkpoint.tensors[step.sources["tensor"]]
            if step.transpose:
                writer.write_tensor(out.name, checkpoint.load(info.name).t().contiguous().to(DTYPES[out.dtype]))
            elif out.dtype == info.dtype:
                writer.copy_bytes(out.name, info)
            else:
                writer.write_tensor(out.name, checkpoint.load(info.name).to(DTYPES[out.dtype]))
        else:
            report = _write_layer(checkpoint, step, plan, writer, method, seed, stats, grouping)
            if report:
                layers.append({"layer": step.layer, **report})
        bar.update(sum(out.nbytes for out in step.outputs))
    writer.close()
    bar.close()
    return sorted(layers, key=lambda row: row["layer"])  # steps follow file order: "layers.10" before "layers.2"


def _write_layer(checkpoint, step, plan: Plan, writer, method, seed: int, stats, grouping: Grouping) -> dict:
    """One layer's attention tensors: read, transform, write. A function of its own so that the
    layer's tensors are freed before the next layer is read (memory stays at one layer's K/V)."""
    from mha2gqa.checkpoint import DTYPES
    from mha2gqa.convert.layer_step import transform_layer
    from mha2gqa.convert.methods import LayerContext

    stored = {role: checkpoint.load(name) for role, name in step.sources.items()}
    context = LayerContext(plan.shape, plan.groups, step.layer, seed, stats and stats.layer(step.layer))
    source_roles = unpack(stored, plan.shape)
    _warn_non_finite(source_roles, step.sources, step.layer)
    roles, report = transform_layer(method, source_roles, context, grouping)
    packed = pack(roles, list(step.sources), plan.groups)
    names = {step.sources[role]: tensor for role, tensor in packed.items()}
    for out in step.outputs:
        writer.write_tensor(out.name, names[out.name].to(DTYPES[out.dtype]))
    return report


def _warn_non_finite(roles: dict, sources: dict, layer: int) -> None:
    """Pooling spreads a NaN/inf in one kv head to its whole group: name the tensor, convert anyway."""
    import torch

    for role in fast.CHECKED_ROLES:
        tensor = roles.get(role)
        if tensor is not None and tensor.is_floating_point():
            fast.warn_non_finite(int((~torch.isfinite(tensor)).sum()), sources, role, layer)


def _copy_other_files(source: Path, out_dir: Path) -> None:
    """Tokenizer, generation config, README and the like: every top-level file but weights and config."""
    for path in source.iterdir():
        if path.is_file() and path.name not in _NOT_COPIED and path.suffix not in (".safetensors", *PICKLE_SUFFIXES):
            shutil.copy2(path, out_dir / path.name)


def _write_config(config: dict, groups: int, dtype: str | None, out_dir: Path) -> None:
    new = converted_config(config, groups)
    if dtype is not None:
        new["dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(new, indent=2) + "\n")


def _write_provenance(
    source: Path, config: dict, plan: Plan, seed: int, dtype: str | None, out_dir: Path, extra: dict | None = None
) -> None:
    provenance.append(
        out_dir,
        "conversion",
        {
            "source": str(source),
            "source_config_sha256": hashlib.sha256((source / "config.json").read_bytes()).hexdigest(),
            "model_type": config["model_type"],
            "method": plan.method,
            "groups": plan.groups,
            "source_kv_heads": plan.shape.kv_heads,
            "heads": plan.shape.heads,
            "seed": seed,
            "dtype": dtype or "unchanged",
            **(extra or {}),
        },
        source=source,
    )
