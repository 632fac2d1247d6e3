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
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from mha2gqa.architecture.layouts import (
    DTYPE_BYTES,
    AttentionShape,
    Layout,
    attention_shape,
    config_vocab,
    layout_for,
    read_config,
    validate_groups,
    validate_target,
)
from mha2gqa.convert import config_file, fast, stage_work
from mha2gqa.convert import counts as kv_counts
from mha2gqa.convert.check import CHECK_TOKENS, CheckPlan, check_logits_bytes, parent_cached, plan_check
from mha2gqa.convert.decide import Decided, decide
from mha2gqa.convert.inputs import (
    CALIBRATION_BATCH,
    GLOBAL_HELDOUT_EVERY,
    OPENING_LENGTH,
    RefineBudget,
    block_length,
    default_tokens,
    heldout_targets_bytes,
    layers_per_pass,
    stats_bytes,
)
from mha2gqa.convert.kv_budget import BUDGET_BLOCKS, loss_tokens
from mha2gqa.convert.options import (
    DEFAULT_CALIBRATION,
    OUT_DTYPES,
    REFINE_TOKENS_PER_HIDDEN,
    ConvertOptions,
    GlobalPrecision,
    Grouping,
    RefineOptions,
    flag_words,
)
from mha2gqa.convert.plan import TensorPlan, make_plan
from mha2gqa.convert.retrieval_keep import RETRIEVAL_WEIGHTED, keep_line, validate_weight
from mha2gqa.convert.rope import validate_calibrated, validate_grouping, validate_refine_layout, validate_rotary_dims
from mha2gqa.corpus import sampling
from mha2gqa.corpus.calibration import CalibrationInput, resolve_calibration
from mha2gqa.corpus.probe import DOMAINS
from mha2gqa.estimates import (
    CALIBRATION_STAGES,
    STORED,
    ConvertWork,
    Estimate,
    RefineWork,
    StageCost,
    check_parts,
    convert_line,
    convert_parts,
    retrieval_part,
)
from mha2gqa.estimates.costs import RUNTIME_BYTES as EVAL_RUNTIME_BYTES
from mha2gqa.estimates.stages import CONVERT
from mha2gqa.files.checkpoint import INDEX_NAME, SafetensorsCheckpoint
from mha2gqa.files.embedded import CORPUS_NAME
from mha2gqa.files.reading import inside, validate_regular
from mha2gqa.files.sources import PICKLE_SUFFIXES, require_safetensors, resolve_model_dir, snapshot_hub_id
from mha2gqa.records import provenance
from mha2gqa.records.card import about_the_source
from mha2gqa.runtime import machine
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.units import format_bytes, parse_size
from mha2gqa.scoring.retrieval_items import HEADS_MAX_LENGTH, probe_grid

NOT_COPIED = {"config.json", INDEX_NAME, provenance.FILE_NAME, config_file.CONFIG_NAME}  # written anew, not copied
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

REFINE_BUFFERS = 4  # (tokens, hidden) float32 buffers refine holds for one layer (refine.BUFFERS)
# Resident memory of the process before any tensor (measured with /usr/bin/time -v on the 2-core
# development machine: numpy executor 46 MiB peak for a whole 21 MiB conversion; python + torch +
# transformers + accelerate imported, 248 MiB).
RUNTIME_BYTES = {"numpy": 48 << 20, "torch": 256 << 20}


def has_tokenizer(source: Path) -> bool:
    """Whether SRC ships a tokenizer (what calibration, the check and the retrieval questions read text with)."""
    return any((source / name).is_file() for name in TOKENIZER_FILES)


@dataclass(frozen=True)
class Stage:
    """One stage of the conversion: its name, the line --dry-run prints, its price and the work that runs it.
    run.execute calls `run` on the run's state in the list's order, under the clock; the estimate sums `parts`."""

    name: str  # a declared stage (estimates/stages.py): calibrate, merge, refine, metadata
    detail: str
    parts: tuple = ()  # its price (estimates.Part): the estimate adds them
    run: Callable | None = None  # stage_work's function; None: skipped, or marked inside the stage before it
    skipped: bool = False  # listed for the reader (statistics passed in, the check off): runs and costs nothing


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
    tensors: TensorPlan
    calibration: CalibrationInput | None  # the text calibration and refine read, resolved once (None: none read)
    stats: object = None  # calibration.CalibrationStats a sweep gathered once, or None
    torch_reason: str | None = None  # why the torch executor runs (None: fast.py, no torch)
    shard_bytes: int = 0
    calibration_memory: int = 0
    refine_budget: RefineBudget | None = None
    stages: list[Stage] = field(default_factory=list)
    # The process' own costs beside the stages (its start, the parent's load): {stage name: parts}, priced once
    process_parts: dict = field(default_factory=dict)
    copied: dict = field(default_factory=dict)  # SRC files copied beside the weights -> size (files_to_copy)
    bytes_written: int = 0  # tensors + copied files + headers and JSON
    scratch_bytes: int = 0  # statistics and refine spill files inside DST's partial folder, removed at the end
    peak_memory: int = 0  # estimated peak resident memory, bytes
    check: CheckPlan | None = None  # the quality check after the write (convert/check.py)
    decided: Decided = field(default_factory=Decided)  # what was chosen from the machine (decide.py), once
    # --kv-budget: the budget in kv heads summed over the layers; the counts are the layer-losses stage's to fill
    # (until then `tensors` holds counts that spend the whole budget: the most DST can hold). None: counts given.
    budget_heads: int | None = None
    losses: object = None  # layer_losses.MeasuredLosses a sweep measured once for every budget, or None
    chosen: dict | None = None  # how the budget chose the counts, once it has (mha2gqa.json's kv_budget)

    @property
    def counts(self) -> tuple[int, ...]:
        """Each layer's kv heads (provisional until the layer-losses stage has chosen them under a budget)."""
        return self.tensors.counts

    @property
    def per_layer(self) -> bool:
        """The layers' counts differ, or a budget may make them differ: written in the Nemotron-NAS format."""
        return self.budget_heads is not None or not kv_counts.is_uniform(self.counts)

    def with_counts(self, counts: tuple[int, ...], chosen: dict | None = None) -> None:
        """The counts the layer-losses stage chose: the tensor plan made again at them (pure, no tensor read)."""
        self.tensors = _tensor_plan(self.checkpoint, self.layout, self.shape, counts, self.options)
        self.chosen = chosen

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token at these counts, in the dtype DST's weights are written in."""
        size = DTYPE_BYTES[self.options.dtype or self.shape.dtype]
        return sum(self.shape.kv_bytes_per_token(count, size) for count in self.counts) // self.shape.layers

    @property
    def parameters(self) -> int:
        """The source's parameters, from its safetensors headers."""
        return sum(math.prod(info.shape) for info in self.checkpoint.tensors.values())

    @property
    def gathers_statistics(self) -> bool:
        """A calibration stage runs: a stage that shapes the weights reads the statistics, or --calibration asked
        for the merge's reconstruction errors (not when only the layer losses read the text)."""
        wanted = self.options.calibration_shapes_weights or self.options.calibration is not None
        return self.calibration is not None and self.stats is None and wanted

    @property
    def loss_blocks(self) -> int:
        """The calibration blocks the layer losses average over: all the text read for them alone, else (the
        text shared with a stage that shapes the weights) its first BUDGET_BLOCKS."""
        blocks = self.calibration.tokens // self.calibration.seq_len
        return min(BUDGET_BLOCKS, blocks) if self.gathers_statistics else blocks

    @property
    def reads_parent(self) -> bool:
        """A stage reads SRC's whole model (the calibration, the layer losses, the retrieval heads): loaded once, in
        the load stage."""
        return self.calibration is not None or self.options.keep_retrieval_heads

    @property
    def measures_losses(self) -> bool:
        """The layer-losses stage runs: a budget to fill, and no losses passed in."""
        return self.budget_heads is not None and self.losses is None

    @property
    def refine(self) -> RefineOptions | None:
        return self.options.refine

    @property
    def calibration_passes(self) -> int:
        """Passes of the calibration tokens through SRC that gather the statistics within --calibration-memory."""
        return -(-self.shape.layers // layers_per_pass(self.calibration_memory, self.shape.hidden))

    def work(self) -> ConvertWork:
        """What the conversion will do, as the numbers its stages are priced from (estimates.convert_parts)."""
        p, calibration, sampled = (
            self.parameters,
            self.calibration,
            self.calibration and self.calibration.sampled_tokens,
        )
        sample = {}
        if sampled:
            seq_len = calibration.seq_len
            chat, batch = sampling.has_chat_template(self.source), sampling.batch_for(self.config, seq_len)
            sample = dict(sampled_tokens=sampled, sample_seq_len=seq_len, sample_chat=chat, sample_batch=batch)
        return ConvertWork(
            parameters=p,
            torch=self.torch_reason is not None,
            bytes_written=self.bytes_written,
            parent_bytes=4 * p if calibration is not None else 0,
            calibrate_tokens=calibration.tokens * self.calibration_passes if self.gathers_statistics else 0,
            loss_tokens=loss_tokens(self.shape, self.loss_blocks * calibration.seq_len) if self.measures_losses else 0,
            retrieval_tokens=retrieval_tokens(self.config) if self.options.keep_retrieval_heads else 0,
            refine=self._refine_work(p),
            **sample,
        )

    def priced(self, start: bool = True, calibration: bool = True) -> list[StageCost]:
        """The estimate's stages: the process' start and the parent's load, then every planned stage that runs, at
        the price it carries; without the sample, statistics and layer losses where a sweep ran them once."""
        names = [CONVERT.start.name] if start else []
        process = self.process_parts
        stages = [StageCost(name, process[name]) for name in names + [CONVERT.load.name] if name in process]
        kept = [s for s in self.stages if s.parts and (calibration or s.name not in CALIBRATION_STAGES)]
        return stages + [StageCost(s.name, s.parts) for s in kept]

    def at_rates(self) -> Estimate:
        """The estimate at the stored rates (estimates.for_this_machine scales it to this machine)."""
        return Estimate(tuple(self.priced()), STORED, self.peak_memory)

    def _refine_work(self, parameters: int) -> RefineWork | None:
        refine, budget = self.options.refine, self.refine_budget
        if refine is None or budget is None:
            return None
        step_tokens = refine.batch_blocks * budget.seq_len + budget.opening_tokens_per_step
        checks = budget.global_heldout_forwards(refine.global_steps, config_vocab(self.config), refine.memory)
        return RefineWork(
            layer_step_work=self.shape.layers * refine.steps * step_tokens * attention_parameters(self.shape),
            fit_tokens=budget.blocks * budget.seq_len + budget.opening_tokens,
            step_tokens=step_tokens,
            global_steps=refine.global_steps,
            global_heldout_forwards=checks,
            global_bf16=refine.global_precision == GlobalPrecision.BFLOAT16,  # explicit here: prepare decided auto
        )

    def command(self) -> str:
        """The `mha2gqa convert` command line that makes this conversion again (byte for byte), with OUT
        for the destination: the model card's Reproduce line. Every flag that changes the output comes from
        the one flag table (options.CONVERT_FLAGS)."""
        return shlex.join(["mha2gqa", "convert", self.source_spec, "OUT", *flag_words(self.reproduced())])

    def config_values(self) -> dict:
        """The same source and options as command(), as DST/convert.yaml's mapping (config_file.render writes it)."""
        return config_file.anywhere({"source": self.source_spec, **config_file.values(self.reproduced())})

    def reproduced(self) -> ConvertOptions:
        """The options that make this conversion again: the calibration as resolved (or the data and tokens of
        a sweep's statistics), left out where no stage that shapes the weights reads it (the per-layer errors
        of a plain merge are a report, not the checkpoint)."""
        o, calibration = self.options, self.calibration
        if calibration is not None:
            o = replace(o, calibration=calibration.spec, calibration_tokens=calibration.tokens)
        elif self.stats is not None:  # a sweep's statistics: their data and tokens make the same ones
            o = replace(o, calibration=self.stats.record.get("data"), calibration_tokens=self.stats.tokens)
        if o.calibration is not None and not o.calibration_shapes_weights:
            o = replace(o, calibration=None, calibration_tokens=None)
        counts = self.counts  # a budget's chosen counts make the same tensors without measuring again
        if kv_counts.is_uniform(counts):
            return replace(o, groups=counts[0], kv_heads_per_layer=None, kv_budget=None)
        return replace(o, groups=None, kv_heads_per_layer=",".join(map(str, counts)), kv_budget=None)

    def describe(self, time_line: str | None = None) -> list[str]:
        """The stages and estimates, one line each, for --dry-run; `time_line` in place of the unscaled one
        (convert_line) when the caller probed the machine (run.dry_run_time_line)."""
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
        lines.append(time_line or convert_line(self.at_rates().seconds()))
        return lines


def prepare(
    src, options: ConvertOptions, stats=None, resolved: CalibrationInput | None = None, losses=None
) -> ConversionPlan:
    """Check the request `options` against the model `src` (a directory or a hub id) and plan it.
    `stats`: calibration.CalibrationStats gathered once by a sweep (then no calibration stage runs); `resolved`:
    the calibration of `options` (or of `stats`) already resolved, by an earlier plan of the same sweep; `losses`:
    layer_losses.MeasuredLosses a sweep measured once (then --kv-budget chooses from them, no layer-losses stage).
    Raises InputError for every mistake that can be known before reading a tensor."""
    _validate_values(options)
    kv_counts.validate_request(options)
    shard_bytes = parse_size(options.max_shard_size)
    source = resolve_model_dir(src)
    # headers only: the sizes config.json is checked against (none: an unsupported type is still named)
    checkpoint = SafetensorsCheckpoint(source) if any(source.glob("*.safetensors")) else None
    config = read_config(source, checkpoint and checkpoint.shapes)
    layout, shape = layout_for(config), attention_shape(config)
    counts, budget = _counts(options, config, shape)
    _validate_calibration_needs(options, config)
    _validate_keep_retrieval(options, source)
    calibration = _calibration_input(options, stats, config, source, resolved, budget is not None and losses is None)
    if options.calibration_tokens is not None and calibration is None and stats is None:
        raise InputError(
            f"--calibration-tokens {options.calibration_tokens}: no stage of this conversion reads calibration text "
            "(--method calibrated, --grouping similarity, --refine, --kv-budget or --calibration do): add one, or "
            "leave --calibration-tokens out"
        )
    options, decided = decide(options, calibration is not None)  # the machine's part, once (decide.py)
    calibrated = calibration is not None or stats is not None
    memory_bytes = parse_size(options.calibration_memory, "--calibration-memory")
    require_safetensors(source, "SRC")
    _validate_not_quantized(source, config)
    provenance.lineage(source)  # a broken SRC/mha2gqa.json fails now, not after every tensor is written
    tensors = _tensor_plan(checkpoint, layout, shape, counts, options)
    torch_reason = (
        (f"{kv_counts.BUDGET_FLAG} chooses the counts from SRC's layer losses" if budget is not None else None)
        or fast.request_refusal(options, config, calibrated)
        or fast.plan_refusal(tensors, checkpoint.tensors)
    )
    plan = ConversionPlan(
        source=source,
        source_spec=snapshot_hub_id(str(source)) or (str(source) if Path(str(src)).expanduser().is_dir() else str(src)),
        options=options,
        config=config,
        layout=layout,
        shape=shape,
        checkpoint=checkpoint,
        tensors=tensors,
        calibration=calibration,
        stats=stats,
        torch_reason=torch_reason,
        shard_bytes=shard_bytes,
        calibration_memory=memory_bytes,
        copied=files_to_copy(source),
        decided=decided,
        budget_heads=budget,
        losses=losses,
    )
    _estimate(plan, calibration.tokens if calibration is not None else stats.tokens if stats is not None else 0)
    return plan


def _counts(options: ConvertOptions, config: dict, shape: AttentionShape) -> tuple[tuple[int, ...], int | None]:
    """Each layer's kv heads as asked (checked), or, under --kv-budget, counts that spend the whole budget (the
    layer-losses stage chooses the real ones), and the budget in kv heads (None: counts given)."""
    flag = kv_counts.asked_flag(options)
    if options.groups is not None:
        validate_groups(shape, options.groups)
    counts, budget = kv_counts.given_counts(options, shape), None
    if counts is None or not kv_counts.is_uniform(counts):  # a format to write them in (a source convert reads)
        kv_counts.validate_per_layer_parent(config, flag)
    if counts is None:
        budget = kv_counts.budget_of(options, shape)
        counts = kv_counts.provisional_counts(budget, shape)
    validate_target(config, min(counts), flag)
    return counts, budget


def _tensor_plan(checkpoint, layout: Layout, shape: AttentionShape, counts, options: ConvertOptions) -> TensorPlan:
    return make_plan(
        checkpoint.tensors,
        layout,
        shape,
        counts,
        options.method.value,
        OUT_DTYPES.get(options.dtype),
        route_query_output=options.method.rewrites_query_output
        or options.grouping != Grouping.CONTIGUOUS
        or options.keep_retrieval_heads,  # its kv heads may move with their query heads
    )


def _validate_keep_retrieval(options: ConvertOptions, source: Path) -> None:
    """--keep-retrieval-heads: a merge that takes weights, and the tokenizer its questions are written with."""
    validate_weight(options.keep_retrieval_heads, options.retrieval_weight)
    if options.check_retrieval and not options.check:
        raise InputError("--check-retrieval is part of the check, and --no-check turns it off: drop one of them")
    if not options.keep_retrieval_heads:
        return
    if options.method not in RETRIEVAL_WEIGHTED:
        raise InputError(
            f"--keep-retrieval-heads weighs kv heads in a merge, and --method {options.method} does not weigh: use "
            f"--method {' or '.join(RETRIEVAL_WEIGHTED)}, or leave --keep-retrieval-heads out"
        )
    if not has_tokenizer(source):
        raise InputError(
            f"--keep-retrieval-heads writes its questions with the source's tokenizer, and {source} has none: copy "
            "the tokenizer files into it"
        )


def _validate_values(options: ConvertOptions) -> None:
    """What the options hold, before any file is read: calibration data (not statistics), a known --dtype."""
    if options.calibration is not None and not isinstance(options.calibration, (str, Path, list, tuple, dict)):
        raise TypeError(
            f"ConvertOptions.calibration is calibration data (a path, a list of paths, a {{source: share}} mix or a "
            f"hub dataset name), not {type(options.calibration).__name__}: pass gathered statistics as "
            "convert(..., stats=...)"
        )
    if options.dtype is not None and options.dtype not in OUT_DTYPES:
        raise InputError(f"--dtype {options.dtype!r} is unknown (valid: {', '.join(OUT_DTYPES)})")


def _validate_calibration_needs(options: ConvertOptions, config: dict) -> None:
    """What the method, grouping and refine need of the model (calibration text they always get: by default
    the parent's samples)."""
    method, grouping, refine = options.method, options.grouping, options.refine
    if method.needs_calibration:
        validate_calibrated(config, method.value)
    if grouping == Grouping.SIMILARITY:
        validate_grouping(config)
    if refine is not None:
        refine.validate()
        validate_refine_layout(config)
    if options.calibration_shapes_weights or options.calibration is not None:
        validate_rotary_dims(config)


def _calibration_input(
    options: ConvertOptions,
    stats,
    config: dict,
    source: Path,
    resolved: CalibrationInput | None = None,
    measures_losses: bool = False,
) -> CalibrationInput | None:
    """The calibration text, resolved once: --calibration; else (refine on a sweep's statistics) the data
    those statistics were gathered from; else, where a stage that shapes the weights or the layer losses of
    --kv-budget need it, the default (the parent's samples); None when nothing reads calibration text. Read only
    by the layer losses, it is their few blocks (layer_losses.BUDGET_BLOCKS unless --calibration-tokens says).
    `resolved`: the same text resolved before (a sweep's), budgeted here for the tokens asked."""
    seq_len, hidden = block_length(config), attention_shape(config).hidden
    tokens = options.calibration_tokens
    if measures_losses and not options.calibration_shapes_weights and tokens is None:
        tokens = BUDGET_BLOCKS * seq_len
    wanted = options.calibration_shapes_weights or measures_losses
    if options.calibration is not None or (stats is None and wanted):
        spec = options.calibration if options.calibration is not None else list(DEFAULT_CALIBRATION)
    elif stats is not None and options.refine is not None:
        spec, tokens = stats.record.get("data"), stats.tokens
    else:
        return None
    if resolved is not None:
        calibration = resolved.budgeted(tokens)
    else:
        # missing files, unknown formats, no text: refused now
        calibration = resolve_calibration(spec, tokens, seq_len, default_tokens(hidden))
    if options.refine is not None and calibration.tokens < 2 * seq_len:
        raise InputError(
            f"--refine needs at least 2 calibration blocks of {seq_len} tokens (got {calibration.tokens} tokens): "
            f"raise --calibration-tokens to {2 * seq_len} or more"
        )
    if not has_tokenizer(source):
        raise InputError(
            f"--calibration needs the source's tokenizer, and {source} has none: copy the tokenizer files into it"
        )
    return calibration


def _estimate(plan: ConversionPlan, calibration_tokens: int) -> None:
    """The stages with their token counts, the bytes DST will hold, and the peak memory."""
    shape, options, tensors = plan.shape, plan.options, plan.tensors
    seq_len = block_length(plan.config)
    plan.bytes_written = tensors.bytes_out + sum(plan.copied.values()) + (1 << 20)  # 1 MiB for headers and JSON
    params = plan.parameters
    model_bytes = 4 * params  # the source loaded in float32 on CPU (calibration.load_source_model)
    layer_bytes = max(
        (sum(plan.checkpoint.tensors[n].nbytes for n in s.sources.values()) for s in tensors.steps if s.is_transform),
        default=0,
    )
    stages, peak = [], 3 * layer_bytes  # the merge: one layer's tensors, their float32 copies, its output
    if plan.calibration is not None and plan.calibration.sampled_tokens:
        batch = sampling.batch_for(plan.config, seq_len)
        stages.append(_sample_stage(plan.calibration, params, batch))
        peak = max(peak, model_bytes + sampling.cache_bytes(plan.config, shape, seq_len, batch))
    if plan.gathers_statistics:
        stages.append(_calibrate_stage(plan, calibration_tokens))
        layers_bytes = shape.layers * stats_bytes(shape.hidden)
        plan.scratch_bytes += layers_bytes
        peak = max(peak, model_bytes + min(layers_bytes, plan.calibration_memory) + _forward_bytes(shape, seq_len))
    elif plan.stats is not None:
        detail = f"skipped: statistics passed in ({plan.stats.tokens:,} tokens)"
        stages.append(Stage(CONVERT.calibrate.name, detail, skipped=True))
    if plan.budget_heads is not None:
        stages.append(_losses_stage(plan))
        if plan.measures_losses:  # the parent, one block's forward and the logits of both sides of the KL
            logits = 2 * seq_len * config_vocab(plan.config) * 4
            peak = max(peak, model_bytes + _forward_bytes(shape, seq_len) // CALIBRATION_BATCH + logits)
    if options.keep_retrieval_heads:
        stages.append(Stage(CONVERT.retrieval_heads.name, keep_line(options, plan.counts)))
    executor = "numpy, no torch" if plan.torch_reason is None else f"torch: {plan.torch_reason}"
    merge = f"{options.method} {_counts_words(plan)}, {options.grouping} grouping, {shape.layers} layers ({executor})"
    if options.keep_retrieval_heads:
        merge += "; the retrieval kv heads weighed and spread"
    if options.refine is None:
        stages.append(Stage(CONVERT.merge.name, merge + f"; {len(tensors.output_tensors())} tensors streamed into DST"))
    else:
        stages.append(Stage(CONVERT.merge.name, merge + "; the merged attention kept in memory for refine"))  # unpriced
        stages += _refine_stages(plan, calibration_tokens, seq_len)
        peak = max(peak, _refine_peak(plan, model_bytes, seq_len))
    plan.check = _plan_check(plan, params)
    runs = plan.check.skip is None  # the check's work (check_parts) counts in the estimate when it runs
    detail = plan.check.describe().removeprefix("check: ")
    stages.append(Stage(CONVERT.check.name, detail, plan.check.parts, skipped=not runs))
    if plan.check.skip is None:
        peak = max(peak, model_bytes + check_logits_bytes(plan.config))
    stages.append(Stage(CONVERT.metadata.name, "config.json, tokenizer and other files, mha2gqa.json, README.md card"))
    plan.stages = _priced_with_work(plan, stages)
    runtime = RUNTIME_BYTES["numpy" if plan.torch_reason is None else "torch"]
    if plan.check.skip is None:  # the check runs the models in transformers, with a tokenizer: eval's runtime
        runtime = max(runtime, EVAL_RUNTIME_BYTES)
    plan.peak_memory = peak + runtime


# The work of each stage that runs (a skipped one, and the global refine stage that refine marks itself, run none).
_WORK = {
    CONVERT.sample.name: stage_work.sample,
    CONVERT.calibrate.name: stage_work.calibrate,
    CONVERT.layer_losses.name: stage_work.layer_losses,
    CONVERT.retrieval_heads.name: stage_work.retrieval_heads,
    CONVERT.merge.name: stage_work.merge,
    CONVERT.refine.name: stage_work.refine,
    CONVERT.write.name: stage_work.write,
    CONVERT.check.name: stage_work.quality_check,
    CONVERT.metadata.name: stage_work.metadata,
}


def _priced_with_work(plan: ConversionPlan, stages: list[Stage]) -> list[Stage]:
    """Each stage with its price (estimates.convert_parts, from the plan's work; the check brings its own) and its
    work: a stage skipped (statistics passed in, the check off) runs nothing and costs nothing."""
    parts = convert_parts(plan.work())
    plan.process_parts = {name: parts[name] for name in (CONVERT.start.name, CONVERT.load.name) if name in parts}
    priced = []
    for stage in stages:
        if stage.skipped:
            priced.append(replace(stage, parts=()))
        elif stage.name == CONVERT.refine_global.name:  # refine runs it and marks it
            priced.append(replace(stage, parts=parts[stage.name]))
        else:
            priced.append(replace(stage, parts=stage.parts or parts.get(stage.name, ()), run=_WORK[stage.name]))
    return priced


def retrieval_tokens(config: dict) -> int:
    """Tokens the parent forwards over --keep-retrieval-heads' scoring questions (retrieval_keep.py)."""
    from mha2gqa.convert.retrieval_keep import scoring_grid

    return scoring_grid(config, seed=0).forward_tokens()


def _plan_check(plan: ConversionPlan, params: int) -> CheckPlan:
    if not has_tokenizer(plan.source):
        return CheckPlan(0, 0, (), 0.0, "SRC has no tokenizer to read the probe texts with")
    vocab = plan.config.get("vocab_size") or 0
    cached = parent_cached(plan.source)
    parts = check_parts(CHECK_TOKENS * len(DOMAINS), params, vocab, plan.torch_reason is None, cached)
    if plan.options.check_retrieval:  # eval's probe at its defaults through DST and SRC, priced as eval prices it
        grid = probe_grid(None, None, None, 0, plan.config.get("max_position_embeddings"))
        parts += (retrieval_part(params, params, grid.forward_tokens(), grid.tokens_up_to(HEADS_MAX_LENGTH)),)
    seconds = sum(part.seconds() for part in parts)
    # The device a stage already decided for the parent (decide.py), else the driver's word without torch: a plain
    # conversion's start stays torch-free, and a wrong guess only makes the check a recorded skip.
    device = plan.decided.device or ("cuda" if machine.cuda_visible() else "cpu")
    found = plan_check(plan.config, params, plan.options.check, seconds, device, parts)
    return replace(found, retrieval=plan.options.check_retrieval)


def _counts_words(plan: ConversionPlan) -> str:
    """How the merge groups the kv heads, in the dry run's words."""
    shape, counts = plan.shape, plan.counts
    if plan.budget_heads is not None:
        return (
            f"to the kv heads per layer the layer losses choose ({plan.budget_heads} of {shape.layers * shape.kv_heads}"
            " kv heads in all)"
        )
    if kv_counts.is_uniform(counts):
        return f"over groups of {shape.kv_heads // counts[0]} kv heads"
    return f"to kv heads per layer {','.join(map(str, counts))} (of {shape.kv_heads})"


def _losses_stage(plan: ConversionPlan) -> Stage:
    """--kv-budget: each layer's loss at each count, then the counts chosen (layer_losses.py)."""
    shape, budget = plan.shape, plan.budget_heads
    choice = (
        f"then the counts with the least summed loss within {budget} kv heads (an exact knapsack), "
        "written in the Nemotron-NAS format where they differ"
    )
    if not plan.measures_losses:
        return Stage(CONVERT.layer_losses.name, f"measured once before (passed in); {choice}")
    seq_len, blocks = plan.calibration.seq_len, plan.loss_blocks
    candidates = len([g for g in shape.valid_groups() if g < shape.kv_heads])
    return Stage(
        CONVERT.layer_losses.name,
        f"each of {shape.layers} layers at each of {candidates} smaller kv-head counts, KL to SRC on {blocks} "
        f"calibration blocks of {seq_len} tokens (about {loss_tokens(shape, blocks * seq_len):,} token forwards "
        f"through SRC); {choice}",
    )


def _sample_stage(calibration: CalibrationInput, params: int, batch: int) -> Stage:
    tokens = calibration.sampled_tokens
    recipe = sampling.DEFAULT_RECIPE
    return Stage(
        CONVERT.sample.name,
        f"{tokens:,} tokens sampled from SRC ({-(-tokens // calibration.seq_len):,} sequences of "
        f"{calibration.seq_len}, up to {batch} at once, {recipe.describe()}, seeded by --seed; about "
        f"{sampling.flops(params, tokens):.2g} FLOPs, a forward per token with the KV cache)",
    )


def _calibrate_stage(plan: ConversionPlan, calibration_tokens: int) -> Stage:
    shape, passes = plan.shape, plan.calibration_passes
    words = _data_words(plan.calibration) if plan.calibration is not None else "the statistics' data"
    return Stage(
        CONVERT.calibrate.name,
        f"up to {calibration_tokens:,} tokens of {words} through SRC "
        f"({passes} pass{'es' if passes > 1 else ''}), statistics of {shape.layers} layers "
        f"({format_bytes(shape.layers * stats_bytes(shape.hidden))} on disk)",
    )


def _refine_stages(plan: ConversionPlan, calibration_tokens: int, seq_len: int) -> list[Stage]:
    """refine's stages, and its RefineBudget (the blocks it fits on) into the plan."""
    shape, refine, tensors = plan.shape, plan.options.refine, plan.tensors
    wanted = refine.tokens or REFINE_TOKENS_PER_HIDDEN * shape.hidden
    blocks = RefineBudget(seq_len, wanted).blocks_of(calibration_tokens // seq_len)
    held = RefineBudget.heldout_of(blocks)
    opened = RefineBudget(seq_len, wanted, blocks)
    buffer_bytes = REFINE_BUFFERS * (blocks * seq_len + opened.opening_tokens) * shape.hidden * 4
    plan.refine_budget = RefineBudget(
        seq_len, wanted, blocks, blocks - held, held, buffer_bytes, buffer_bytes > refine.memory
    )
    if plan.refine_budget.spills:
        plan.scratch_bytes += buffer_bytes
    where = "memory-mapped files inside DST's partial folder" if plan.refine_budget.spills else "in memory"
    stages = [
        Stage(
            CONVERT.refine.name,
            f"{shape.layers} layers x {refine.steps} Adam steps (lr {refine.lr:g}, {refine.batch_blocks} blocks "
            f"a step){', then the o_proj solve' if refine.solve_output else ''}; up to {(blocks - held) * seq_len:,} "
            f"fit and {held * seq_len:,} held-out tokens in blocks of {seq_len}, beside {opened.openings:,} openings of "
            f"{OPENING_LENGTH} tokens (every first token kept, the attention sink); activations "
            f"{format_bytes(buffer_bytes)} {where}",
        )
    ]
    if refine.global_steps:
        stages.append(
            Stage(
                CONVERT.refine_global.name,
                f"then up to {refine.global_steps} Adam steps (lr {refine.global_lr:g}, {refine.batch_blocks} blocks "
                f"a step) of every refined attention parameter, all layers together, against the parent's "
                f"next-token distribution{_precision_words(refine.global_precision, plan.decided.why.get('--refine-global-precision'))}; the held-out KL checked every "
                f"{GLOBAL_HELDOUT_EVERY} steps in float32, the best kept ({_targets_words(plan)})",
            )
        )
    stages.append(
        Stage(
            CONVERT.write.name, f"{len(tensors.output_tensors())} tensors streamed into DST, refined attention included"
        )
    )
    return stages


def _precision_words(precision: GlobalPrecision, why: str | None) -> str:
    """The fit steps' precision, explicit by now (decide.py), with why where `auto` chose it."""
    return f", in {precision}{' autocast' if precision == GlobalPrecision.BFLOAT16 else ''}" + (
        f" ({why})" if why else ""
    )


def _targets_words(plan: ConversionPlan) -> str:
    budget, memory = plan.refine_budget, plan.options.refine.memory
    held = heldout_targets_bytes(budget.heldout_tokens, config_vocab(plan.config))
    if budget.keeps_parent_targets(config_vocab(plan.config), memory):
        return f"the parent's logits on the {budget.heldout_tokens:,} held-out tokens kept between checks: {format_bytes(held)}"
    return (
        f"the parent's logits on the held-out tokens ({format_bytes(held)}) are over --refine-memory, so they are "
        "computed again at each check"
    )


def _refine_peak(plan: ConversionPlan, model_bytes: int, seq_len: int) -> int:
    """refine's peak memory: both models, the merged attention, one layer's activations (unless spilled),
    then the global stage's gradients and activations."""
    shape, options, budget = plan.shape, plan.options, plan.refine_budget
    merged = [out for s in plan.tensors.steps if s.is_transform for out in s.outputs]  # the attention tensors
    attention = sum(out.nbytes for out in merged)
    converted = model_bytes if options.dtype else 0  # with --dtype the converted model holds its own cast copy
    buffers = 0 if budget.spills else budget.buffer_bytes
    peak = model_bytes + converted + 3 * attention + buffers + _forward_bytes(shape, seq_len)
    if options.refine.global_steps:  # the layer buffers are freed by then
        trained = sum(math.prod(out.shape) for out in merged)
        kept = budget.kept_targets_bytes(config_vocab(plan.config), options.refine.memory)
        peak = max(peak, model_bytes + converted + kept + _global_bytes(plan.config, shape, seq_len, trained))
    return peak


def _global_bytes(config: dict, shape: AttentionShape, seq_len: int, trained: int) -> int:
    """The global stage beyond the two models, float32: for the `trained` attention values their gradients,
    two Adam moments, the best check's copy and float32 masters (when the weights are not float32), one
    block's activations through every layer kept for the backward, and 7 vocabulary-wide rows per token: the
    KL's (both models' logits, their log-softmaxes, the exp, the difference and the product; the held-out
    openings go through it a block's worth at a time). Roughly: 32 hidden-wide values a token per layer is what
    SmolLM2's run needed (3.25 and 3.32 GiB peak RSS measured on two seeds, 3.28 GiB estimated; docs/refine.md)."""
    vocab = config_vocab(config)
    activations = shape.layers * seq_len * (32 * shape.hidden + shape.heads * seq_len) * 4
    return 5 * trained * 4 + activations + 7 * seq_len * vocab * 4


def _forward_bytes(shape: AttentionShape, seq_len: int) -> int:
    """The largest activations of one calibration forward (a batch of blocks), float32: a few hidden-wide
    tensors per token and one layer's attention scores. Roughly: the MLP's width is not in the shape."""
    return CALIBRATION_BATCH * seq_len * (8 * shape.hidden + shape.heads * seq_len) * 4


def _data_words(calibration: CalibrationInput) -> str:
    if calibration.mixed:
        return "a mix of " + ", ".join(f"{p.name} {p.share:.0%}" for p in calibration.parts)
    (part,) = calibration.parts
    if part.sampled:
        return "samples of SRC"
    if part.name == CORPUS_NAME:
        return "the embedded novels"
    return part.name if len(part.entries) < 2 or ", " in part.name else f"{len(part.entries)} files"


def _validate_not_quantized(src: Path, config: dict) -> None:
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
    """Tokenizer, generation config, README and the like: every top-level entry but folders, weights,
    config and what describes the source itself (card.about_the_source), with its size. Each must be a regular file inside SRC, whatever its name: a link out
    of SRC or a FIFO is refused here, before anything is written, never followed or left out."""
    found = {}
    for path in sorted(source.iterdir()):
        if path.name in NOT_COPIED or path.suffix in (".safetensors", *PICKLE_SUFFIXES):
            continue
        if path.is_dir() and inside(path, source):
            continue
        found[path] = validate_regular(path, source)
        if about_the_source(path):  # the parent's own provenance, log or results: false beside the new model
            del found[path]
    return found


def attention_parameters(shape: AttentionShape) -> int:
    """q, k, v and o of one layer of the source."""
    q = shape.hidden * shape.heads * shape.head_dim
    return 2 * q + 2 * shape.hidden * shape.kv_heads * shape.head_dim
