"""`convert --kv-heads-per-layer 4,2,2,...`: each layer its own kv-head count, mean-pooled, written as a
Nemotron-NAS checkpoint (nemotron_nas/blocks.py), the format vLLM, SGLang, TensorRT-LLM, MLX-LM and llama.cpp
read per-layer kv heads from.

Planned with convert's own machinery: prepare() makes every check of SRC and DST (at the smallest count) and
make_plan() one plan per distinct count; the layer step of layer i comes from the plan of its count, every other
tensor passes through as a uniform conversion copies it. The writer pass below is run.py's, with the count read
per layer.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from mha2gqa import jsontext, provenance
from mha2gqa.card import write_card
from mha2gqa.checkpoint import ShardedWriter, atomic_directory
from mha2gqa.convert.options import OUT_DTYPES, ConvertOptions, Grouping, Method
from mha2gqa.convert.plan import Step, make_plan
from mha2gqa.convert.prepare import ConversionPlan, prepare
from mha2gqa.convert.roles import pack, unpack
from mha2gqa.convert.run import cast_to_output, copy_validated_files, validate_destination_outside
from mha2gqa.errors import InputError, import_torch
from mha2gqa.layouts import DTYPE_BYTES, AttentionShape, attention_shape, read_config
from mha2gqa.nemotron_nas.blocks import MODEL_TYPE, nemotron_nas_config
from mha2gqa.progress import progress_bar
from mha2gqa.sources import resolve_model_dir

FLAG = "--kv-heads-per-layer"
PARENT_TYPES = ("llama",)  # the readers build Llama attention and MLP blocks (vLLM's DeciLMDecoderLayer)


@dataclass
class PerLayerPlan:
    """A checked per-layer request: prepare()'s plan (checks, copied files, shard size) and the layer steps."""

    base: ConversionPlan
    counts: tuple[int, ...]
    steps: list[Step]
    config: dict  # DST's config.json
    chosen: dict | None = None  # how --kv-budget chose the counts (kv_budget.py), recorded in mha2gqa.json

    @property
    def shape(self) -> AttentionShape:
        return self.base.shape

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, at these counts, in the dtype DST's weights are written in."""
        size = DTYPE_BYTES[self.base.options.dtype or self.shape.dtype]
        return sum(self.shape.kv_bytes_per_token(count, size) for count in self.counts) // self.shape.layers


def parse_counts(text: str) -> tuple[int, ...]:
    """'4,2,2' -> (4, 2, 2); InputError naming the flag for anything else."""
    words = [word.strip() for word in str(text).split(",")]
    if not all(word.isdigit() and int(word) > 0 for word in words):
        raise InputError(
            f"{FLAG} {text!r}: give one positive integer per layer, separated by commas (e.g. {FLAG} 4,2,2,1)"
        )
    return tuple(int(word) for word in words)


def validate_counts(counts: tuple[int, ...], shape: AttentionShape) -> None:
    """One count per layer, each a divisor of the source's kv heads, at least one below it."""
    listed = ", ".join(str(g) for g in shape.valid_groups())
    if len(counts) != shape.layers:
        raise InputError(
            f"{FLAG} gives {len(counts)} counts but SRC has {shape.layers} layers: give one kv-head count per layer"
        )
    for layer, count in enumerate(counts):
        if shape.kv_heads % count:
            raise InputError(
                f"{FLAG}: layer {layer}'s {count} must divide num_key_value_heads={shape.kv_heads} (valid: {listed})"
            )
    if min(counts) == shape.kv_heads:
        raise InputError(
            f"{FLAG}: every layer keeps its {shape.kv_heads} kv heads: nothing to convert; lower some (valid: {listed})"
        )


def plan_per_layer(src, dst, counts: tuple[int, ...], options: ConvertOptions) -> PerLayerPlan:
    """Every check of the request, before anything is written. `options`: convert's, at their defaults but for
    --dtype, --seed, --max-shard-size, --force and --quiet (the mean merge reads nothing else)."""
    source = resolve_model_dir(src)
    config = read_config(source)
    if config.get("model_type") not in PARENT_TYPES:
        raise InputError(
            f"{FLAG}: SRC has model_type {config.get('model_type')!r}; per-layer kv heads are written in the "
            f"Nemotron-NAS format, whose readers build Llama blocks (supported: {', '.join(PARENT_TYPES)})"
        )
    shape = attention_shape(config)
    validate_counts(counts, shape)
    written = dict(config, dtype=options.dtype) if options.dtype else config
    new_config = nemotron_nas_config(written, list(counts))  # refuses an MLP width the format cannot state
    base = prepare(
        src, replace(options, groups=min(counts), method=Method.MEAN, grouping=Grouping.CONTIGUOUS, check=False)
    )
    validate_destination_outside(base.source, Path(dst).expanduser(), options.force)
    steps = _layer_steps(base, counts)
    return PerLayerPlan(base, counts, steps, new_config)


def _layer_steps(base: ConversionPlan, counts: tuple[int, ...]) -> list[Step]:
    """base's steps with layer i's attention step taken from the plan at counts[i]."""
    tensors, out_dtype = base.checkpoint.tensors, OUT_DTYPES.get(base.options.dtype)
    by_count = {
        count: {s.layer: s for s in make_plan(tensors, base.layout, base.shape, count, "mean", out_dtype).steps}
        for count in set(counts)
    }
    return [by_count[counts[step.layer]][step.layer] if step.is_transform else step for step in base.tensors.steps]


def execute_per_layer(plan: PerLayerPlan, dst) -> Path:
    """Write DST: the tensors (one layer's K/V in memory at a time), copied files, config.json, mha2gqa.json."""
    base, dst = plan.base, Path(dst).expanduser()
    outputs = [out for step in plan.steps for out in step.outputs]
    needed = sum(out.nbytes for out in outputs) + sum(base.copied.values())
    with atomic_directory(dst, replace=base.options.force, needed_bytes=needed) as tmp:
        import_torch()
        _write_tensors(plan, outputs, Path(tmp))
        copy_validated_files(base.copied, base.source, tmp)
        (Path(tmp) / "config.json").write_text(jsontext.model_config(plan.config, indent=2) + "\n")
        provenance.append(tmp, "conversion", _record(plan), source=base.source)
        write_card(tmp, base.source, dst.name)
    return dst


def _write_tensors(plan: PerLayerPlan, outputs, out_dir: Path) -> None:
    from mha2gqa.convert.layer_step import transform_layer
    from mha2gqa.convert.methods import METHODS, LayerContext

    base = plan.base
    checkpoint, shape = base.checkpoint, base.shape
    copies = base.tensors.copies(checkpoint.tensors)
    bar = progress_bar(sum(out.nbytes for out in outputs), "convert", base.options.progress, unit="B", unit_scale=True)
    with ShardedWriter(out_dir, outputs, base.shard_bytes, copies) as writer:
        for step in plan.steps:
            if step.is_transform:
                count = plan.counts[step.layer]
                stored = {role: checkpoint.load(name) for role, name in step.sources.items()}
                context = LayerContext(shape, count, step.layer, base.options.seed)
                roles, _ = transform_layer(METHODS[Method.MEAN], unpack(stored, shape), context)
                packed = {step.sources[role]: t for role, t in pack(roles, list(step.sources), count).items()}
                for out in step.outputs:
                    writer.write_tensor(out.name, cast_to_output(packed[out.name], out))
            elif step.outputs[0].name in copies:
                writer.copy_bytes(step.outputs[0].name, copies[step.outputs[0].name])
            else:
                out = step.outputs[0]
                writer.write_tensor(out.name, cast_to_output(checkpoint.load(step.sources["tensor"]), out))
            bar.update(sum(out.nbytes for out in step.outputs))
    bar.close()


def _command_words(plan: PerLayerPlan) -> list[str]:
    options = plan.base.options
    words = ["mha2gqa", "convert", plan.base.source_spec, "OUT", FLAG, ",".join(map(str, plan.counts))]
    return words + (["--dtype", options.dtype] if options.dtype else [])


def _record(plan: PerLayerPlan) -> dict:
    """The conversion stage of mha2gqa.json. `groups` is the mean count (the KV bytes it prices are the sum over
    layers); `kv_heads_per_layer` the counts themselves."""
    base, shape = plan.base, plan.shape
    return {
        "source": str(base.source),
        "source_config_sha256": hashlib.sha256((base.source / "config.json").read_bytes()).hexdigest(),
        "model_type": base.config["model_type"],
        "method": Method.MEAN.value,
        "groups": sum(plan.counts) / len(plan.counts),
        "kv_heads_per_layer": list(plan.counts),
        "format": MODEL_TYPE,
        "source_kv_heads": shape.kv_heads,
        "heads": shape.heads,
        "seed": base.options.seed,
        "dtype": base.options.dtype or "unchanged",
        "grouping": Grouping.CONTIGUOUS.value,
        "kv_bytes_per_token": plan.kv_bytes_per_token(),
        "command": shlex.join(_command_words(plan)),  # the card's Reproduce line: the counts, so the same bytes
        "source_kv_bytes_per_token": shape.kv_bytes_per_token(),
        **({"kv_budget": plan.chosen} if plan.chosen else {}),
    }
