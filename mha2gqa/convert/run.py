"""`convert` = `prepare` (every check, no torch: prepare.py) then `execute` (the stages, in order).

execute runs the plan's stages forward, each input read once: the calibration text is tokenized once
and the parent loaded once, for the statistics and for --refine; every tensor, merged or refined,
goes through the one streaming writer into a partial DST that becomes DST atomically. Two executors
write the merge: fast.py (numpy, no torch imported) for the plain methods where its output is
byte-identical, and the torch one below for everything else; torch is imported only there.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mha2gqa import jsontext, provenance
from mha2gqa.card import write_card
from mha2gqa.checkpoint import ShardedWriter, atomic_directory, validate_destination
from mha2gqa.convert import config_file, fast
from mha2gqa.convert.counts import target_words
from mha2gqa.convert.options import ConvertOptions
from mha2gqa.convert.plan import TensorPlan
from mha2gqa.convert.prepare import ConversionPlan, prepare
from mha2gqa.convert.roles import pack, unpack
from mha2gqa.errors import InputError, import_torch
from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.estimates.stages import CONVERT
from mha2gqa.layouts import converted_config
from mha2gqa.nemotron_nas.blocks import MODEL_TYPE as NEMOTRON_NAS
from mha2gqa.nemotron_nas.blocks import nemotron_nas_config
from mha2gqa.progress import progress_bar
from mha2gqa.reading import open_regular, resolve, short_read
from mha2gqa.units import format_bytes
from mha2gqa.writing import validate_room, validate_unclaimed, write_atomic


@dataclass
class ConversionResult:
    tensors: TensorPlan  # every output tensor and what it is made of (the plan's `tensors`)
    dst: Path | None  # None for a dry run
    source: Path
    # Per layer (with calibration or grouping): key_error, value_error, kv_order.
    layers: list[dict] = field(default_factory=list)
    refine: dict | None = None  # with refine: options, token counts and per-layer output errors
    plan: ConversionPlan | None = None  # the checked request and its stages (what --dry-run prints)
    check: dict | None = None  # what the conversion kept (convert/check.py), or {"skipped": why}
    checked: str | None = None  # a dry run: what it checked at DST (the run's checks before its first byte)
    retrieval_heads: dict | None = None  # --keep-retrieval-heads: SRC's heads found (retrieval_keep.KeptHeads.record)
    retrieval_line: str | None = None  # and its line for the terminal
    kv_budget: dict | None = None  # --kv-budget: how the layer losses chose the counts (mha2gqa.json's kv_budget)


def validate_destination_outside(src: Path, dst: Path, force: bool) -> None:
    """DST may be neither inside SRC nor hold it, then writing.validate_destination's rule (per_layer.py too)."""
    src_r, dst_r = resolve(src), resolve(dst)  # a link loop is one ELOOP line, not a RuntimeError
    if dst_r == src_r or src_r in dst_r.parents:
        raise InputError(f"DST {dst} is inside SRC {src}: choose a directory outside the source model")
    if dst_r in src_r.parents:
        raise InputError(f"DST {dst} contains SRC {src}: replacing it would delete the source; choose another DST")
    validate_destination(dst, force)


def convert(
    src, dst, groups: int | None = None, options: ConvertOptions | None = None, stats=None, clock=NO_CLOCK, **kwargs
) -> ConversionResult:
    """Convert the model at `src` (directory or hub id) to `groups` kv heads, written to `dst`.
    The keywords are the fields of ConvertOptions (convert/options.py, one docstring each); or pass
    `options=ConvertOptions(...)`. With `calibration` (files, folders or a hub dataset: mha2gqa.corpus.textdata),
    per-layer statistics of the attention input are gathered first (calibrated merge, similarity grouping,
    reconstruction errors); statistics gathered once for several conversions (calibration.calibrate, or a
    sweep's pass) come as `stats` instead. With `refine`, the merged attention is then refined layer by layer against the parent
    on the calibration tokens (convert/refine/) before anything is written. clock: an
    estimates Clock that says the run's estimate before it starts and times its stages (the CLI's)."""
    if options is None:
        options = ConvertOptions.from_kwargs(groups, kwargs)
    elif kwargs or groups is not None:
        raise TypeError("convert(): pass either options=ConvertOptions(...) or groups and keywords, not both")
    plan = plan_conversion(src, dst, options, stats)
    if options.dry_run:
        checked = validate_output(plan, Path(dst).expanduser())
        return ConversionResult(plan.tensors, None, plan.source, plan=plan, checked=checked)
    return execute(plan, dst, clock)


def plan_conversion(src, dst, options: ConvertOptions, stats=None, resolved=None, losses=None) -> ConversionPlan:
    """prepare, then the destination's checks: everything convert refuses before it writes. `resolved`: the
    calibration already resolved for an earlier plan (a sweep plans every candidate from one resolution);
    `losses`: the layer losses a sweep measured once for its --kv-budgets."""
    plan = prepare(src, options, stats, resolved, losses)
    validate_destination_outside(plan.source, Path(dst).expanduser(), options.force)
    return plan


def validate_output(plan: ConversionPlan, dst: Path) -> str:
    """What the run checks at DST before its first byte, checked by a dry run without writing anything: no
    other run holds DST, and DST's filesystem is writable and holds what the run writes (the estimate, with
    its scratch files). Returns the line that says so."""
    validate_unclaimed(dst, f"DST {dst}")
    needed = plan.bytes_written + plan.scratch_bytes
    folder = validate_room(dst.parent, needed, f"DST {dst}")
    return (
        f"checked: {folder} is writable and has {format_bytes(shutil.disk_usage(folder).free)} free for the "
        f"{format_bytes(needed)} the run writes"
    )


def estimate(plan: ConversionPlan):
    """The run's estimate, scaled to this machine (when the run is long enough to be worth a probe:
    estimates.for_this_machine) by a probe of the library that does most of its work: torch (with the threads it
    was given) for a torch executor or when the quality check runs (it imports torch anyway, and on a busy machine
    torch's one thread and numpy's two slow down apart: a numpy probe made a busy SmolLM2 mean conversion's
    estimate 1.65x its time), numpy for a torch-free conversion left unchecked."""
    from mha2gqa.estimates import convert_estimate, for_this_machine

    checked = plan.check is not None and plan.check.skip is None
    probe = "torch" if plan.torch_reason is not None or checked else "numpy"
    return for_this_machine(convert_estimate(plan.work()), probe, fine=plan.options.refine is not None)


def dry_run_time_line(plan: ConversionPlan) -> str | None:
    """--dry-run's time, scaled to this machine by the probe the run would take (estimate: none for a short run),
    when the run would start torch anyway (calibration, refine, a torch merge: the long runs); None for a
    torch-free plan, whose dry run stays torch-free and prints the rates unscaled. Why: unscaled, SmolLM2's
    default calibrated + refine conversion said about 55 min where it took 37 min 51 s alone and its own scaled
    estimate said 36."""
    if plan.torch_reason is None:
        return None
    from mha2gqa.estimates import convert_estimate, convert_line, rates

    if rates.probe_rounds(convert_estimate(plan.work()).seconds(), ["torch"]):  # torch only for a probe it will take
        import_torch()  # with the interrupt signals held, as the run starts it
    return convert_line(plan.work(), estimate(plan))


def execute(plan: ConversionPlan, dst: Path, clock=NO_CLOCK) -> ConversionResult:
    """Run the stages of `plan` into a new `dst`: calibrate -> merge -> refine -> write -> metadata."""
    options, source = plan.options, plan.source
    dst = Path(dst).expanduser()
    validate_destination_outside(source, dst, options.force)
    # Claimed, checked for room and cleared of debris before calibration, the long part, starts. The
    # statistics ((d+1)^2 float64 per layer: GBs for a 7B) and refine's spill files live inside the partial
    # directory, so they count against DST's room, not a small /tmp, and a killed run's are removed with
    # its debris.
    with (
        atomic_directory(dst, replace=options.force, needed_bytes=plan.bytes_written + plan.scratch_bytes) as tmp,
        tempfile.TemporaryDirectory(prefix=".calibration-", dir=tmp) as scratch,
    ):
        if plan.torch_reason is not None:  # started first: the probe runs on torch's threads, and "start" ends here
            import_torch()
            clock.stage(CONVERT.load.name)
        clock.begin(lambda: estimate(plan))  # once DST is claimed: a refusal of it stays one line
        layers, refined, stats, parent, kept = [], None, plan.stats, None, None
        if plan.torch_reason is None:
            clock.stage(CONVERT.merge.name)
            fast.write_tensors(plan.checkpoint, plan.tensors, tmp, plan.shard_bytes, options.progress)
        else:
            layers, refined, stats, parent, kept = _run_torch(plan, tmp, Path(scratch), clock)
        copy_validated_files(plan.copied, source, tmp)
        _write_config(plan, tmp)
        checked = _check(plan, tmp, dst, parent, clock)
        del parent
        clock.stage(CONVERT.metadata.name)
        extra = {
            "grouping": options.grouping.value,
            "retrieval_heads": kept.record() if kept else None,
            "calibration": stats.record if stats else None,
            "layers": layers,
            "refine": refined,
            "command": plan.command(),
            "torch_threads": _torch_threads(plan),  # the same bytes again need the same count (card: Reproduce)
            "device": plan.decided.device,  # where the parent ran (None: no stage ran it): GPU and CPU sums differ
            "decided": plan.decided.why or None,  # what the plan chose from the machine, and why (decide.py)
            "config": plan.config_values(),  # DST/convert.yaml's mapping; the card shows it
            "check": {k: v for k, v in checked.items() if k not in RUN_FACTS},
        }
        write_atomic(tmp / config_file.CONFIG_NAME, config_file.render(extra["config"]))
        _write_provenance(plan, tmp, extra)
        write_card(tmp, source, dst.name)  # README.md from mha2gqa.json; a copied source card moves to SOURCE_README.md
    clock.finish()
    found = (kept.record(), kept.summary_line()) if kept else (None, None)
    return ConversionResult(plan.tensors, dst, source, layers, refined, plan, checked, None, *found, plan.chosen)


def _kept_for_check(plan: ConversionPlan, parent):
    """The loaded parent when the check will score it (loaded once per convert), else None (freed)."""
    return parent if plan.check is not None and plan.check.skip is None else None


def _check(plan: ConversionPlan, written: Path, dst: Path, parent=None, clock=NO_CLOCK) -> dict:
    """The quality check of the model now complete in the partial DST (weights, config, tokenizer), before its
    record is written: what it kept goes into mha2gqa.json and the card with the rest, atomically."""
    check, options = plan.check, plan.options
    if check is None or check.skip is not None:
        return {"skipped": check.skip if check else "not planned"}
    clock.stage(CONVERT.check.name)
    import_torch()
    from mha2gqa.convert.check import next_steps
    from mha2gqa.convert.check_run import run_check_or_skip

    record = run_check_or_skip(plan.source, written, check, options.progress, parent)  # never raises: a skip
    if "skipped" in record:
        return record
    full = options.method.needs_calibration and options.refine is not None
    target = target_words(plan.counts)
    record["next"] = next_steps(record["verdict"], plan.source_spec, str(dst), target, full, record["device"])
    return record


RUN_FACTS = ("seconds", "parent_cached")  # of this run, not of the model: printed, kept out of mha2gqa.json


def _torch_threads(plan: ConversionPlan) -> int | None:
    """torch's CPU thread count when a stage fitted weights to the calibration (its matrix products' float
    sums depend on it), else None: a merge alone gives the same bytes on any count, and on either executor."""
    if plan.torch_reason is None or not plan.options.calibration_shapes_weights:
        return None
    import torch

    return torch.get_num_threads()


def _run_torch(plan: ConversionPlan, out_dir: Path, scratch: Path, clock=NO_CLOCK):
    """The torch stages: the calibration ids read once, the parent loaded once (for the statistics and for
    refine), the merge, refine, and the one writer pass. Returns (per-layer merge report, refine record,
    statistics, the parent kept for the check, SRC's retrieval heads with --keep-retrieval-heads)."""
    import_torch()  # first, with interrupts held: a signal during torch's start-up would abort
    from mha2gqa.convert import calibration

    options, stats = plan.options, plan.stats
    ids = parent = record = None
    if plan.calibration is not None:  # statistics to gather, or refine's blocks (a sweep's statistics' data)
        parent = calibration.load_source_model(plan.source, plan.decided.device, progress=options.progress)
        if stats is not None and stats.ids is not None and options.calibration is None:  # a sweep's: read once
            ids = stats.ids
        else:
            if plan.calibration.sampled_tokens:
                clock.stage(CONVERT.sample.name)
            ids, record = calibration.read_ids(plan.source, plan.calibration, parent, options.seed, options.progress)
    if plan.budget_heads is not None:  # the counts, before anything is merged at them
        clock.stage(CONVERT.layer_losses.name)
        _choose_counts(plan, parent, ids, record)
    kept = None
    if options.keep_retrieval_heads:  # scored before the merge it weighs; the parent is loaded once
        if parent is None:
            parent = calibration.load_source_model(plan.source, plan.decided.device, progress=options.progress)
        kept = _retrieval_heads(plan, parent)
    if plan.gathers_statistics:
        clock.stage(CONVERT.calibrate.name)
        stats = _gather(plan, parent, ids, record, scratch)
    if plan.refine is None:
        parent = _kept_for_check(plan, parent)  # the merge needs one layer at a time, not the model
        clock.stage(CONVERT.merge.name)
        return _write_tensors(plan, out_dir, stats, kept=kept), None, stats, parent, kept
    from mha2gqa.convert.refine import refine_attention

    clock.stage(CONVERT.refine.name)
    merged, layers = _merge(plan, stats, kept)
    refined, record = refine_attention(
        parent,
        plan.layout,
        plan.shape,
        target_config(plan),
        merged,
        ids,
        plan.refine,
        plan.refine_budget,
        out_dtype=options.dtype,
        spill_dir=out_dir,
        progress=options.progress,
        clock=clock,
    )
    del merged
    parent = _kept_for_check(plan, parent)
    clock.stage(CONVERT.write.name)
    _write_tensors(plan, out_dir, stats, computed=refined)
    return layers, record, stats, parent, kept


def _choose_counts(plan: ConversionPlan, parent, ids, record) -> None:
    """--kv-budget: the layer losses (measured now on the loaded parent, or passed in by a sweep) choose the counts,
    and the tensor plan is made again at them before the merge."""
    from mha2gqa.convert.layer_losses import choose, measure

    measured = plan.losses if plan.losses is not None else measure(parent, ids, plan, record)
    plan.with_counts(*choose(plan, measured))


def _gather(plan: ConversionPlan, parent, ids, record: dict, scratch: Path):
    """The calibration statistics of `ids` through the loaded parent, spilled into `scratch` past its memory."""
    from mha2gqa.convert import calibration

    shape, memory, progress = plan.shape, plan.calibration_memory, plan.options.progress
    return calibration.gather(
        parent, plan.calibration, ids, record, plan.layout, shape, plan.source, scratch, memory, progress
    )


def _retrieval_heads(plan: ConversionPlan, parent):
    """SRC's retrieval heads (convert/retrieval_keep.py), scored on questions written with SRC's tokenizer."""
    from transformers import AutoTokenizer

    from mha2gqa.convert.retrieval_keep import score_parent, weight_of

    tokenizer = AutoTokenizer.from_pretrained(plan.source, trust_remote_code=False)
    options = plan.options
    return score_parent(parent, tokenizer, plan.counts, weight_of(options), options.seed, options.progress)


def _write_tensors(
    plan: ConversionPlan, out_dir: Path, stats=None, computed: dict | None = None, kept=None
) -> list[dict]:
    """The torch executor's one writer pass, every method, grouping and layout: each step of the plan in
    order, a layer merged as it comes. `computed`: tensors made before the pass (refined attention, by
    checkpoint name), written as they are. Returns the per-layer merge report."""

    checkpoint, tensors, computed = plan.checkpoint, plan.tensors, computed or {}
    copies = {name: source for name, source in tensors.copies(checkpoint.tensors).items() if name not in computed}
    bar = progress_bar(tensors.bytes_out, "convert", plan.options.progress, unit="B", unit_scale=True)
    layers = []
    with ShardedWriter(out_dir, tensors.output_tensors(), plan.shard_bytes, copies) as writer:
        for step in tensors.steps:
            made = [out.name in computed for out in step.outputs]
            if all(made):
                for out in step.outputs:
                    writer.write_tensor(out.name, cast_to_output(computed[out.name], out))
            elif any(made):
                raise RuntimeError(f"refine made only some of the tensors of {step.sources}")
            elif not step.is_transform:
                out, info = step.outputs[0], checkpoint.tensors[step.sources["tensor"]]
                if step.transpose:
                    writer.write_tensor(out.name, cast_to_output(checkpoint.load(info.name).t().contiguous(), out))
                elif out.dtype == info.dtype:
                    writer.copy_bytes(out.name, info)
                else:
                    writer.write_tensor(out.name, cast_to_output(checkpoint.load(info.name), out))
            else:
                merged, report = _merge_layer(plan, step, stats, kept)
                for out in step.outputs:
                    writer.write_tensor(out.name, merged[out.name])
                if report:
                    layers.append({"layer": step.layer, **report})
            bar.update(sum(out.nbytes for out in step.outputs))
    bar.close()
    return _by_layer(layers)


def _merge(plan: ConversionPlan, stats, kept=None) -> tuple[dict, list[dict]]:
    """Every layer's merged attention tensors (checkpoint name -> tensor in its output dtype), held for
    refine, and the per-layer merge report."""
    merged, layers = {}, []
    for step in plan.tensors.steps:
        if step.is_transform:
            tensors, report = _merge_layer(plan, step, stats, kept)
            merged.update(tensors)
            if report:
                layers.append({"layer": step.layer, **report})
    return merged, _by_layer(layers)


def _by_layer(layers: list[dict]) -> list[dict]:
    return sorted(layers, key=lambda row: row["layer"])  # steps follow file order: "layers.10" before "layers.2"


def _merge_layer(plan: ConversionPlan, step, stats, kept=None) -> tuple[dict, dict]:
    """One layer's attention tensors read and transformed: (output name -> tensor in its output dtype,
    report). A function of its own so that the layer's source tensors are freed before the next layer
    is read (memory stays at one layer's K/V)."""
    from mha2gqa.convert.layer_step import transform_layer
    from mha2gqa.convert.methods import METHODS, LayerContext

    options, shape, count = plan.options, plan.shape, plan.counts[step.layer]
    stored = {role: plan.checkpoint.load(name) for role, name in step.sources.items()}
    masses = kept.masses(step.layer) if kept is not None else None
    context = LayerContext(
        shape,
        count,
        step.layer,
        options.seed,
        stats and stats.layer(step.layer),
        retrieval_masses=masses if masses is not None and bool((masses > 0).any()) else None,
        retrieval_weight=kept.weight if kept is not None else 0.0,
    )
    source_roles = unpack(stored, shape)
    _warn_non_finite(source_roles, step.sources, step.layer)
    if count == shape.kv_heads:  # a layer that keeps its kv heads (per-layer counts): no method touches it
        roles, report = source_roles, {}
    else:
        roles, report = transform_layer(METHODS[options.method], source_roles, context, options.grouping)
    packed = pack(roles, list(step.sources), count)
    names = {step.sources[role]: tensor for role, tensor in packed.items()}
    return {out.name: cast_to_output(names[out.name], out) for out in step.outputs}, report


def cast_to_output(tensor, out):
    """`tensor` in the output's dtype, under casts.validate_cast's rule (no inf, no tensor flushed to zero)."""
    from mha2gqa.checkpoint import torch_dtypes
    from mha2gqa.convert.casts import torch_range, validate_cast

    dtypes = torch_dtypes()
    source = next(code for code, dtype in dtypes.items() if dtype == tensor.dtype)
    if source != out.dtype and tensor.is_floating_point():
        validate_cast(out.name, *torch_range(tensor), source, out.dtype)
    return tensor.to(dtypes[out.dtype])


def _warn_non_finite(roles: dict, sources: dict, layer: int) -> None:
    """Pooling spreads a NaN/inf in one kv head to its whole group: name the tensor, convert anyway."""
    import torch

    for role in fast.FINITE_SCANNED_ROLES:
        tensor = roles.get(role)
        if tensor is not None and tensor.is_floating_point():
            fast.warn_non_finite(int((~torch.isfinite(tensor)).sum()), sources, role, layer)


def copy_validated_files(files: dict[Path, int], source: Path, out_dir: Path) -> None:
    """Copy the files prepare checked (prepare.files_to_copy), each read to its checked size: a file
    that changed since is a changing source, one line."""
    for path, size in files.items():
        copied = 0
        with open_regular(path, source) as src, open(out_dir / path.name, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                copied += len(chunk)
        if copied != size:
            raise short_read(path)
        shutil.copystat(path, out_dir / path.name)


def target_config(plan: ConversionPlan) -> dict:
    """DST's config.json: the source's at the counts (stock where every layer has the same count, else the
    Nemotron-NAS format: nemotron_nas/blocks.py), with --dtype's name."""
    written = dict(plan.config, dtype=plan.options.dtype) if plan.options.dtype else plan.config
    counts = plan.counts
    if len(set(counts)) == 1:
        return converted_config(written, counts[0])
    return nemotron_nas_config(written, list(counts))


def _write_config(plan: ConversionPlan, out_dir: Path) -> None:
    (out_dir / "config.json").write_text(jsontext.model_config(target_config(plan), indent=2) + "\n")


def _write_provenance(plan: ConversionPlan, out_dir: Path, extra: dict) -> None:
    """mha2gqa.json's conversion stage. Per-layer counts: `groups` is their mean (the KV bytes it prices are the
    sum over layers) and `kv_heads_per_layer` the counts themselves, with the format and the bytes per token."""
    source, options, tensors = plan.source, plan.options, plan.tensors
    counts, shape = plan.counts, plan.shape
    per_layer = {}
    if len(set(counts)) > 1:
        per_layer = {
            "kv_heads_per_layer": list(counts),
            "format": NEMOTRON_NAS,
            "kv_bytes_per_token": plan.kv_bytes_per_token(),
            "source_kv_bytes_per_token": shape.kv_bytes_per_token(),
        }
    provenance.append(
        out_dir,
        "conversion",
        {
            "source": str(source),
            "source_config_sha256": hashlib.sha256((source / "config.json").read_bytes()).hexdigest(),
            "model_type": plan.config["model_type"],
            "method": tensors.method,
            "groups": tensors.groups if tensors.groups is not None else sum(counts) / len(counts),
            **per_layer,
            "source_kv_heads": shape.kv_heads,
            "heads": shape.heads,
            "seed": options.seed,
            "dtype": options.dtype or "unchanged",
            **({"kv_budget": plan.chosen} if plan.chosen else {}),
            **extra,
        },
        source=source,
    )
