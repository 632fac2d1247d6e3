"""`prepare(src, options) -> ConversionPlan`: every check of a convert request, and what it will do.

Torch-free, and nothing touches the disk: the source's config.json, safetensors headers and file
list are read, every flag is checked against them, and the stages to run are listed with their
estimates (calibrate -> merge -> refine -> metadata). `convert --dry-run` prints this object, the
model card's Reproduce line is its `command()`, the demo checks its flags through it, and
`run.execute(plan, dst)` runs it. So a mistake that can be known before reading tensors is refused
here, before DST, its lock or any statistics exist.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from mha2gqa import provenance
from mha2gqa.card import hub_id
from mha2gqa.checkpoint import INDEX_NAME, SafetensorsCheckpoint
from mha2gqa.convert import fast
from mha2gqa.convert.options import ConvertOptions, Grouping, RefineOptions
from mha2gqa.convert.plan import Plan, make_plan
from mha2gqa.convert.rope import check_calibrated, check_grouping, check_refine_layout
from mha2gqa.embedded import CORPUS_NAME, expand_corpus_name
from mha2gqa.errors import InputError
from mha2gqa.estimates import convert_line
from mha2gqa.layouts import (
    AttentionShape,
    Layout,
    attention_shape,
    check_groups,
    check_target,
    layout_for,
    read_config,
)
from mha2gqa.reading import check_regular, inside
from mha2gqa.sources import PICKLE_SUFFIXES, require_safetensors, resolve_model_dir
from mha2gqa.units import format_bytes

OUT_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # --dtype -> safetensors code
NOT_COPIED = {"config.json", INDEX_NAME, provenance.FILE_NAME}  # written anew, not copied from SRC
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
CALIBRATION_SEQ_LEN = 512  # tokens per calibration block, or the model's context when shorter
CALIBRATION_BATCH = 8  # blocks per calibration forward (calibration.collect_statistics)
HOLDOUT_FRACTION = 1 / 8  # of the refine blocks, held out to check each layer's fit
REFINE_BUFFERS = 4  # (tokens, hidden) float32 buffers refine holds for one layer (refine.BUFFERS)
TOKENS_PER_HIDDEN = 64  # default --refine-tokens per unit of hidden size (docs/refine.md)
# Resident memory of the process before any tensor (measured with /usr/bin/time -v on the 2-core
# development machine: numpy executor 46 MiB peak for a whole 21 MiB conversion; python + torch +
# transformers + accelerate imported, 248 MiB).
RUNTIME_BYTES = {"numpy": 48 << 20, "torch": 256 << 20}


@dataclass(frozen=True)
class Stage:
    """One stage of the conversion as --dry-run prints it."""

    name: str  # calibrate, merge, refine, metadata
    detail: str


@dataclass(frozen=True)
class RefineBudget:
    """The calibration blocks --refine fits and checks on (the real counts follow the data, which may be
    shorter than --calibration-tokens)."""

    seq_len: int
    blocks: int
    fit_blocks: int
    heldout_blocks: int
    buffer_bytes: int  # REFINE_BUFFERS x blocks x seq_len x hidden float32
    spills: bool  # buffer_bytes > RefineOptions.memory: memory-mapped files inside DST's partial folder


@dataclass
class ConversionPlan:
    """A checked convert request: the source, the tensor plan, how each stage runs, and its estimates."""

    source: Path
    source_spec: str  # SRC for the card's command: a hub id (also one the hub cache resolved), else the folder
    options: ConvertOptions
    config: dict
    layout: Layout
    shape: AttentionShape
    checkpoint: SafetensorsCheckpoint
    tensors: Plan
    calibration_data: str | list[str] | None  # what mha2gqa.textdata reads ('austen' expanded to files)
    stats: object = None  # calibration.CalibrationStats a sweep gathered once, or None
    torch_reason: str | None = None  # why the torch executor runs (None: fast.py, no torch)
    shard_bytes: int = 0
    calibration_memory: int = 0
    refine_budget: RefineBudget | None = None
    stages: list[Stage] = field(default_factory=list)
    copied: dict = field(default_factory=dict)  # SRC files copied beside the weights -> size (files_to_copy)
    bytes_written: int = 0  # tensors + copied files + headers and JSON
    scratch_bytes: int = 0  # statistics and refine spill files inside DST's partial folder, removed at the end
    peak_memory: int = 0  # estimated peak resident memory, bytes

    @property
    def gathers_statistics(self) -> bool:
        return self.calibration_data is not None and self.stats is None

    @property
    def refine(self) -> RefineOptions | None:
        return self.options.refine

    def command(self) -> str:
        """The `mha2gqa convert` command line that makes this conversion again (byte for byte), with OUT
        for the destination: the model card's Reproduce line."""
        o = self.options
        words = ["mha2gqa", "convert", self.source_spec, "OUT", "--groups", str(o.groups), "--method", o.method.value]
        if o.seed:
            words += ["--seed", str(o.seed)]
        if o.grouping != Grouping.CONTIGUOUS:
            words += ["--grouping", o.grouping.value]
        if o.dtype:
            words += ["--dtype", o.dtype]
        if parse_size(o.max_shard_size) != parse_size(ConvertOptions.max_shard_size):
            words += ["--max-shard-size", str(o.max_shard_size)]
        data, tokens = o.calibration, o.calibration_tokens
        if data is None and self.stats is not None:  # a sweep's statistics: their data and tokens make the same ones
            data, tokens = self.stats.record.get("data"), self.stats.tokens
        if data is not None:
            entries = [data] if isinstance(data, (str, Path)) else [str(entry) for entry in data]
            if entries == expand_corpus_name(CORPUS_NAME):
                entries = [CORPUS_NAME]
            for entry in entries:
                words += ["--calibration", str(entry)]
            words += ["--calibration-tokens", str(tokens)]
        notes = []
        if o.refine is not None:
            r, default = o.refine, RefineOptions()
            words += ["--refine", "--refine-steps", str(r.steps), "--refine-lr", repr(r.lr)]
            if r.tokens is not None:
                words += ["--refine-tokens", str(r.tokens)]
            python_only = {
                name: getattr(r, name)
                for name in ("batch_blocks", "solve_output")
                if getattr(r, name) != getattr(default, name)
            }
            if r.seed != o.seed:
                python_only["seed"] = r.seed
            if python_only:
                notes.append("RefineOptions(" + ", ".join(f"{k}={v!r}" for k, v in python_only.items()) + ") in Python")
        line = shlex.join(words)
        return line + (f"  # and {'; '.join(notes)}" if notes else "")

    def describe(self) -> list[str]:
        """The stages and estimates, one line each, for --dry-run."""
        lines = [f"stage {i}: {s.name}: {s.detail}" for i, s in enumerate(self.stages, 1)]
        lines.append(
            f"estimates: {format_bytes(self.bytes_written)} written to DST"
            + (
                f" (+ {format_bytes(self.scratch_bytes)} of scratch files inside it while running)"
                if self.scratch_bytes
                else ""
            )
            + f"; peak memory about {format_bytes(self.peak_memory)}"
        )
        lines.append(convert_line(self))
        return lines


def prepare(src, options: ConvertOptions, stats=None) -> ConversionPlan:
    """Check the request `options` against the model `src` (a directory or a hub id) and plan it.
    `stats`: calibration.CalibrationStats gathered once by a sweep (then no calibration stage runs).
    Raises InputError for every mistake that can be known before reading a tensor."""
    dtype, method, grouping, refine = options.dtype, options.method, options.grouping, options.refine
    if options.calibration is not None and not isinstance(options.calibration, (str, Path, list, tuple)):
        raise TypeError(
            f"ConvertOptions.calibration is calibration data (a path, a list of paths or a hub dataset name), not "
            f"{type(options.calibration).__name__}: pass gathered statistics as convert(..., stats=...)"
        )
    if dtype is not None and dtype not in OUT_DTYPES:
        raise InputError(f"--dtype {dtype!r} is unknown (valid: {', '.join(OUT_DTYPES)})")
    shard_bytes = parse_size(options.max_shard_size)
    source = resolve_model_dir(src)
    # headers only: the sizes config.json is checked against (none: an unsupported type is still named)
    checkpoint = SafetensorsCheckpoint(source) if any(source.glob("*.safetensors")) else None
    config = read_config(source, checkpoint and checkpoint.shapes)
    layout, shape = layout_for(config), attention_shape(config)
    check_groups(shape, options.groups)
    check_target(config, options.groups)
    calibrated = options.calibration is not None or stats is not None
    if not calibrated and method.needs_calibration:
        raise InputError(
            f"--method {method} needs calibration data: add --calibration DATA "
            "(a text file, a directory of them, or 'austen' for the embedded novels)"
        )
    if not calibrated and grouping == Grouping.SIMILARITY:
        raise InputError("--grouping similarity needs calibration data: add --calibration DATA")
    if method.needs_calibration:
        check_calibrated(config, method.value)
    if grouping == Grouping.SIMILARITY:
        check_grouping(config)
    if refine is not None:
        if not calibrated:
            raise InputError(
                "--refine needs calibration data to fit against: add --calibration DATA "
                "(a text file, a directory of them, or 'austen' for the embedded novels)"
            )
        refine.check()
        check_refine_layout(config)
    seq_len = block_length(config)
    if options.calibration is not None and (
        not isinstance(options.calibration_tokens, int) or options.calibration_tokens < 1
    ):
        raise InputError(f"--calibration-tokens {options.calibration_tokens} must be at least 1 (e.g. 131072)")
    calibration_tokens = (
        stats.tokens if stats is not None and options.calibration is None else options.calibration_tokens
    )
    if refine is not None and calibration_tokens < 2 * seq_len:
        raise InputError(
            f"--refine needs at least 2 calibration blocks of {seq_len} tokens (got {calibration_tokens} tokens): "
            f"raise --calibration-tokens to {2 * seq_len} or more"
        )
    memory_bytes = parse_size(options.calibration_memory, "--calibration-memory")
    data = _calibration_data(options, stats)
    if data is not None:
        from mha2gqa import textdata

        textdata.resolve("--calibration", data)  # missing files, unknown formats, empty folders: now
        if not any((source / name).is_file() for name in TOKENIZER_FILES):
            raise InputError(
                f"--calibration needs the source's tokenizer, and {source} has none: copy the tokenizer files into it"
            )
    require_safetensors(source, "SRC")
    _check_not_quantized(source, config)
    provenance.lineage(source)  # a broken SRC/mha2gqa.json fails now, not after every tensor is written
    copied = files_to_copy(source)
    tensors = make_plan(
        checkpoint.tensors,
        layout,
        shape,
        options.groups,
        method.value,
        OUT_DTYPES.get(dtype),
        route_query_output=method.rewrites_query_output or grouping != Grouping.CONTIGUOUS,
    )
    torch_reason = fast.request_refusal(options, config, calibrated) or fast.plan_refusal(tensors, checkpoint.tensors)
    plan = ConversionPlan(
        source=source,
        source_spec=hub_id(str(source)) or (str(source) if Path(str(src)).expanduser().is_dir() else str(src)),
        options=options,
        config=config,
        layout=layout,
        shape=shape,
        checkpoint=checkpoint,
        tensors=tensors,
        calibration_data=data,
        stats=stats,
        torch_reason=torch_reason,
        shard_bytes=shard_bytes,
        calibration_memory=memory_bytes,
        copied=copied,
    )
    _estimate(plan, calibration_tokens, seq_len)
    return plan


def parse_size(text: str | int, flag: str = "--max-shard-size") -> int:
    """'5GB' (10^9), '500MiB' (2^20) or plain bytes, as transformers reads --max-shard-size.
    `flag` is the option the size came from, for the message."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise InputError(f"{flag} {text!r} is not a size: use e.g. 5GB, 500MB or 2GiB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}.get(unit) or 2 ** (
        10 * "KMGT".index(unit[0]) + 10
    )
    if number * scale < 1:
        raise InputError(f"{flag} {text!r} must be positive")
    return int(number * scale)


def block_length(config: dict) -> int:
    """Tokens per calibration block: 512, or the model's context when shorter (calibration and refine)."""
    context = config.get("max_position_embeddings")
    return min(CALIBRATION_SEQ_LEN, context) if isinstance(context, int) and context > 0 else CALIBRATION_SEQ_LEN


def refine_blocks(available: int, seq_len: int, wanted_tokens: int) -> int:
    """How many of `available` calibration blocks --refine uses: all of them, or `wanted_tokens` worth
    spread evenly over them (at least 2)."""
    if wanted_tokens < available * seq_len:
        return min(available, max(2, wanted_tokens // seq_len))
    return available


def heldout_blocks(blocks: int) -> int:
    return max(1, round(blocks * HOLDOUT_FRACTION))


def _calibration_data(options: ConvertOptions, stats) -> str | list[str] | None:
    """What the calibration text is read from: --calibration ('austen': the embedded novels), else, when
    refine needs the tokens of statistics passed in, the data those statistics recorded."""
    if options.calibration is not None:
        return expand_corpus_name(options.calibration)
    if stats is not None and options.refine is not None:
        return stats.record.get("data")
    return None


def _estimate(plan: ConversionPlan, calibration_tokens: int, seq_len: int) -> None:
    """The stages with their token counts, the bytes DST will hold, and the peak memory."""
    shape, options, tensors = plan.shape, plan.options, plan.tensors
    plan.bytes_written = tensors.bytes_out + sum(plan.copied.values()) + (1 << 20)  # 1 MiB for headers and JSON
    params = sum(math.prod(info.shape) for info in plan.checkpoint.tensors.values())
    model_bytes = 4 * params  # the source loaded in float32 on CPU (calibration.load_source_model)
    layer_bytes = max(
        (sum(plan.checkpoint.tensors[n].nbytes for n in s.sources.values()) for s in tensors.steps if s.is_transform),
        default=0,
    )
    stages, peak = [], 3 * layer_bytes  # the merge: one layer's tensors, their float32 copies, its output
    if plan.gathers_statistics:
        stats_bytes = shape.layers * (shape.hidden + 1) ** 2 * 8
        per_pass = max(1, plan.calibration_memory // ((shape.hidden + 1) ** 2 * 8))
        passes = -(-shape.layers // per_pass)
        stages.append(
            Stage(
                "calibrate",
                f"up to {calibration_tokens:,} tokens of {_data_words(options.calibration)} through SRC "
                f"({passes} pass{'es' if passes > 1 else ''}), statistics of {shape.layers} layers "
                f"({format_bytes(stats_bytes)} on disk)",
            )
        )
        plan.scratch_bytes += stats_bytes
        peak = max(peak, model_bytes + min(stats_bytes, plan.calibration_memory) + _forward_bytes(shape, seq_len))
    elif plan.stats is not None:
        stages.append(Stage("calibrate", f"skipped: statistics passed in ({plan.stats.tokens:,} tokens)"))
    executor = "numpy, no torch" if plan.torch_reason is None else f"torch: {plan.torch_reason}"
    r = shape.kv_heads // options.groups
    merge = (
        f"{options.method} over groups of {r} kv heads, {options.grouping} grouping, {shape.layers} layers ({executor})"
    )
    refine = options.refine
    if refine is None:
        stages.append(Stage("merge", merge + f"; {len(tensors.output_tensors())} tensors streamed into DST"))
    else:
        stages.append(Stage("merge", merge + "; the merged attention kept in memory for refine"))
        available = calibration_tokens // seq_len
        blocks = refine_blocks(available, seq_len, refine.tokens or TOKENS_PER_HIDDEN * shape.hidden)
        held = heldout_blocks(blocks)
        buffer_bytes = REFINE_BUFFERS * blocks * seq_len * shape.hidden * 4
        spills = buffer_bytes > refine.memory
        plan.refine_budget = RefineBudget(seq_len, blocks, blocks - held, held, buffer_bytes, spills)
        where = "memory-mapped files inside DST's partial folder" if spills else "in memory"
        stages.append(
            Stage(
                "refine",
                f"{shape.layers} layers x {refine.steps} Adam steps (lr {refine.lr:g}, {refine.batch_blocks} blocks "
                f"a step){', then the o_proj solve' if refine.solve_output else ''}; up to {(blocks - held) * seq_len:,} "
                f"fit and {held * seq_len:,} held-out tokens in blocks of {seq_len}; activations "
                f"{format_bytes(buffer_bytes)} {where}",
            )
        )
        if refine.global_steps:
            stages.append(
                Stage(
                    "refine (global)",
                    f"then up to {refine.global_steps} Adam steps (lr {refine.global_lr:g}, {refine.batch_blocks} blocks "
                    f"a step) of every refined attention parameter, all layers together, against the parent's "
                    f"next-token distribution; the held-out KL checked every 5 steps, the best kept",
                )
            )
        stages.append(
            Stage("write", f"{len(tensors.output_tensors())} tensors streamed into DST, refined attention included")
        )
        if spills:
            plan.scratch_bytes += buffer_bytes
        merged = [out for s in tensors.steps if s.is_transform for out in s.outputs]  # the attention tensors
        attention = sum(out.nbytes for out in merged)
        converted = model_bytes if options.dtype else 0  # with --dtype the converted model holds its own cast copy
        peak = max(
            peak,
            model_bytes + converted + 3 * attention + (0 if spills else buffer_bytes) + _forward_bytes(shape, seq_len),
        )
        if refine.global_steps:  # the layer buffers are freed by then
            trained = sum(math.prod(out.shape) for out in merged)
            peak = max(peak, model_bytes + converted + _global_bytes(plan.config, shape, seq_len, trained))
    stages.append(Stage("metadata", "config.json, tokenizer and other files, mha2gqa.json, README.md card"))
    plan.stages = stages
    plan.peak_memory = peak + RUNTIME_BYTES["numpy" if plan.torch_reason is None else "torch"]


def _global_bytes(config: dict, shape: AttentionShape, seq_len: int, trained: int) -> int:
    """The global stage beyond the two models, float32: for the `trained` attention values their gradients,
    two Adam moments, the best check's copy and float32 masters (when the weights are not float32), one
    block's activations through every layer kept for the backward, and a few vocabulary-wide rows per
    token (both models' logits and their log-softmaxes). Roughly: 32 hidden-wide values a token per layer
    is what SmolLM2's run needed (3.18 GiB peak RSS measured, 2.86 GiB estimated; docs/refine.md)."""
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else 0
    activations = shape.layers * seq_len * (32 * shape.hidden + shape.heads * seq_len) * 4
    return 5 * trained * 4 + activations + 4 * seq_len * vocab * 4


def _forward_bytes(shape: AttentionShape, seq_len: int) -> int:
    """The largest activations of one calibration forward (a batch of blocks), float32: a few hidden-wide
    tensors per token and one layer's attention scores. Roughly: the MLP's width is not in the shape."""
    return CALIBRATION_BATCH * seq_len * (8 * shape.hidden + shape.heads * seq_len) * 4


def _data_words(data) -> str:
    if isinstance(data, (list, tuple)):
        return f"{len(data)} files" if len(data) != 1 else str(data[0])
    return "the embedded novels" if data == CORPUS_NAME else str(data)


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


def files_to_copy(source: Path) -> dict[Path, int]:
    """Tokenizer, generation config, README and the like: every top-level entry but folders, weights
    and config, with its size. Each must be a regular file inside SRC, whatever its name: a link out
    of SRC or a FIFO is refused here, before anything is written, never followed or left out."""
    found = {}
    for path in sorted(source.iterdir()):
        if path.name in NOT_COPIED or path.suffix in (".safetensors", *PICKLE_SUFFIXES):
            continue
        if path.is_dir() and inside(path, source):
            continue
        found[path] = check_regular(path, source)
    return found
