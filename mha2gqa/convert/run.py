"""`convert` = `prepare` (every check, no torch: prepare.py) then `execute` (the plan's stages, in order).

execute runs the stages the plan lists, each with the work it carries (stage_work.py), under the clock, in a
partial DST that becomes DST atomically: each input is read once, every tensor goes through the one streaming
writer. Two executors write the merge: fast.py (numpy, no torch imported) for the plain methods where its output
is byte-identical, and the torch one for everything else; torch is imported only there.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mha2gqa.convert.options import ConvertOptions
from mha2gqa.convert.plan import TensorPlan
from mha2gqa.convert.prepare import ConversionPlan, prepare
from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.estimates.stages import CONVERT
from mha2gqa.files.checkpoint import atomic_directory, validate_destination
from mha2gqa.files.reading import resolve
from mha2gqa.files.writing import validate_room, validate_unclaimed
from mha2gqa.runtime.errors import InputError, import_torch
from mha2gqa.runtime.units import format_bytes


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
        return ConversionResult(tensors=plan.tensors, dst=None, source=plan.source, plan=plan, checked=checked)
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
    from mha2gqa.estimates import for_this_machine

    checked = plan.check is not None and plan.check.skip is None
    probe = "torch" if plan.torch_reason is not None or checked else "numpy"
    return for_this_machine(plan.at_rates(), probe, fine=plan.options.refine is not None)


def dry_run_time_line(plan: ConversionPlan) -> str | None:
    """--dry-run's time, scaled to this machine by the probe the run would take (estimate: none for a short run),
    when the run would start torch anyway (calibration, refine, a torch merge: the long runs); None for a
    torch-free plan, whose dry run stays torch-free and prints the rates unscaled. Why: unscaled, SmolLM2's
    default calibrated + refine conversion said about 55 min where it took 37 min 51 s alone and its own scaled
    estimate said 36."""
    if plan.torch_reason is None:
        return None
    from mha2gqa.estimates import convert_line, rates

    priced = plan.at_rates().seconds()
    if rates.probe_rounds(priced, ["torch"]):  # torch only for a probe it will take
        import_torch()  # with the interrupt signals held, as the run starts it
    return convert_line(priced, estimate(plan))


def execute(plan: ConversionPlan, dst: Path, clock=NO_CLOCK) -> ConversionResult:
    """Run the stages of `plan` into a new `dst`, in the order the plan lists them, each under the clock (its
    work: stage_work.py); what the last one leaves is DST, renamed into place whole."""
    from mha2gqa.convert.stage_work import RunState

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
        state = RunState(plan, Path(tmp), Path(scratch), dst, clock)
        if plan.torch_reason is not None:  # started first: the probe runs on torch's threads, and "start" ends here
            import_torch()
            clock.stage(CONVERT.load.name)
        clock.begin(lambda: estimate(plan))  # once DST is claimed: a refusal of it stays one line
        if plan.reads_parent:  # the load stage's: loaded once, before the first stage that reads it
            state.parent()
        for stage in plan.stages:
            if stage.run is not None:
                clock.stage(stage.name)
                stage.run(state)
    clock.finish()
    kept = state.kept
    found = (kept.record(), kept.summary_line()) if kept else (None, None)
    return ConversionResult(
        tensors=plan.tensors,
        dst=dst,
        source=source,
        layers=state.layers,
        refine=state.refine_record,
        plan=plan,
        check=state.checked,
        retrieval_heads=found[0],
        retrieval_line=found[1],
        kv_budget=plan.chosen,
    )
