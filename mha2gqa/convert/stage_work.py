"""The work of each conversion stage: the function a planned stage carries (prepare.Stage.run), run in order by
run.execute on one RunState.

Each input is read once, whichever stage needs it first: the parent is loaded once (the samples, the statistics,
the layer losses, the retrieval heads, refine and the check all use the same model), the calibration ids are read
once. Every tensor, merged or refined, goes through the one streaming writer into the partial DST. Torch is
imported by the stages that need it, never at import: prepare plans with this module on a torch-free start.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mha2gqa.architecture.layouts import converted_config
from mha2gqa.convert import config_file, fast
from mha2gqa.convert.counts import is_uniform, target_words
from mha2gqa.convert.roles import pack, unpack
from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.files import jsontext
from mha2gqa.files.checkpoint import ShardedWriter
from mha2gqa.files.reading import open_regular, short_read
from mha2gqa.files.writing import write_atomic
from mha2gqa.nemotron_nas.blocks import MODEL_TYPE as NEMOTRON_NAS
from mha2gqa.nemotron_nas.blocks import nemotron_nas_config
from mha2gqa.nemotron_nas.remote_code import write_remote_code
from mha2gqa.records import provenance
from mha2gqa.records.card import write_card
from mha2gqa.runtime.errors import import_torch
from mha2gqa.runtime.progress import progress_bar

RUN_FACTS = ("seconds", "parent_cached")  # of this run, not of the model: printed, kept out of mha2gqa.json


@dataclass
class RunState:
    """What the stages of one conversion hand each other: the partial DST, the inputs read once, the results."""

    plan: object  # prepare.ConversionPlan (prepare imports this module: no import back)
    out_dir: Path  # the partial DST
    scratch: Path  # statistics' spill files, inside it
    dst: Path  # where DST will be (the check's next commands name it)
    clock: object = NO_CLOCK
    stats: object = None  # calibration statistics (a sweep's, or gathered here)
    kept: object = None  # --keep-retrieval-heads: SRC's retrieval heads (retrieval_keep.KeptHeads)
    layers: list = field(default_factory=list)  # the merge's per-layer report
    merged: dict | None = None  # the merged attention held for refine
    refined: dict | None = None  # refine's tensors by checkpoint name
    refine_record: dict | None = None
    checked: dict | None = None  # the check's record, or {"skipped": why}
    _parent: object = None
    _ids: object = None
    _ids_record: dict | None = None

    def __post_init__(self):
        self.stats = self.plan.stats

    def parent(self):
        """SRC loaded once, on the plan's device."""
        if self._parent is None:
            import_torch()
            from mha2gqa.convert.calibration import load_source_model

            self._parent = load_source_model(self.plan.source, self.plan.decided.device, progress=self.progress)
        return self._parent

    def ids(self):
        """The calibration ids, read once (a sweep's statistics carry theirs); their record. The parent is loaded
        here only when the calibration samples it."""
        if self._ids is None:
            stats, plan = self.plan.stats, self.plan
            if stats is not None and stats.ids is not None and plan.options.calibration is None:
                self._ids = stats.ids
            else:
                from mha2gqa.corpus.calibration import read_calibration

                self._ids, self._ids_record = read_calibration(
                    plan.calibration, plan.source, plan.options.seed, self.parent, progress=self.progress
                )
        return self._ids, self._ids_record

    def release_parent(self) -> None:
        """Free the parent unless the check will score it (the writer needs one layer at a time, not the model)."""
        check = self.plan.check
        if check is None or check.skip is not None:
            self._parent = None

    @property
    def progress(self) -> bool:
        return self.plan.options.progress


# ---- the stages, in the order prepare lists them ----


def sample(state: RunState) -> None:
    """Text sampled from SRC for the calibration (with any files of the mix): the ids everything after reads."""
    state.ids()


def calibrate(state: RunState) -> None:
    """The statistics of the calibration ids through the parent, spilled into the scratch folder past their memory."""
    from mha2gqa.convert import calibration

    plan = state.plan
    ids, record = state.ids()
    state.stats = calibration.gather(
        state.parent(), plan.calibration, ids, record, plan.layout, plan.shape, plan.source, state.scratch,
        plan.calibration_memory, state.progress,
    )  # fmt: skip


def layer_losses(state: RunState) -> None:
    """--kv-budget: the layer losses (measured now, or a sweep's) choose the counts; the tensor plan is made again
    at them before anything is merged."""
    from mha2gqa.convert.layer_losses import choose, measure

    plan = state.plan
    measured = plan.losses
    if measured is None:
        ids, record = state.ids()
        measured = measure(state.parent(), ids, plan, record, stats=state.stats)
    plan.with_counts(*choose(plan, measured))


def retrieval_heads(state: RunState) -> None:
    """--keep-retrieval-heads: SRC's retrieval heads, scored on questions written with SRC's tokenizer."""
    from transformers import AutoTokenizer

    from mha2gqa.convert.retrieval_keep import score_parent, weight_of

    plan, options = state.plan, state.plan.options
    tokenizer = AutoTokenizer.from_pretrained(plan.source, trust_remote_code=False)
    state.kept = score_parent(state.parent(), tokenizer, plan.counts, weight_of(options), options.seed, state.progress)


def merge(state: RunState) -> None:
    """The merge: streamed into DST (numpy where it is byte-identical, else torch), or, before --refine, held."""
    plan = state.plan
    if plan.refine is not None:
        state.merged, state.layers = _merge_all(plan, state.stats, state.kept)
        return
    if plan.torch_reason is None:
        fast.write_tensors(plan.checkpoint, plan.tensors, state.out_dir, plan.shard_bytes, state.progress)
    else:
        state.release_parent()
        state.layers = _write_tensors(plan, state.out_dir, state.stats, kept=state.kept)
    _complete(state)


def refine(state: RunState) -> None:
    """Layer by layer against the parent, then all layers together (the global stage marks itself)."""
    from mha2gqa.convert.refine import refine_attention

    plan = state.plan
    ids, _ = state.ids()
    state.refined, state.refine_record = refine_attention(
        state.parent(), plan.layout, plan.shape, target_config(plan), state.merged, ids, plan.refine,
        plan.refine_budget, out_dtype=plan.options.dtype, spill_dir=state.out_dir, progress=state.progress,
        clock=state.clock,
    )  # fmt: skip
    state.merged = None


def write(state: RunState) -> None:
    """The refined attention and every other tensor, in one writer pass."""
    state.release_parent()
    _write_tensors(state.plan, state.out_dir, state.stats, computed=state.refined)
    _complete(state)


def quality_check(state: RunState) -> None:
    """The quality check of the model now complete in the partial DST, before its record is written: what it kept
    goes into mha2gqa.json and the card with the rest, atomically. Never raises: a failure is a recorded skip."""
    import_torch()
    from mha2gqa.convert.check import next_steps
    from mha2gqa.convert.check_run import run_check_or_skip

    plan, options = state.plan, state.plan.options
    parent = state.parent() if state._parent is not None else None
    record = run_check_or_skip(plan.source, state.out_dir, plan.check, state.progress, parent)
    state._parent = None
    if "skipped" not in record:
        full = options.method.needs_calibration and options.refine is not None
        target = target_words(plan.counts)
        record["next"] = next_steps(record["verdict"], plan.source_spec, str(state.dst), target, full, record["device"])
    state.checked = record


def metadata(state: RunState) -> None:
    """DST/convert.yaml, mha2gqa.json (how DST was made, what the check found) and the card."""
    plan, out_dir = state.plan, state.out_dir
    state._parent = None
    if state.checked is None:
        state.checked = {"skipped": plan.check.skip if plan.check else "not planned"}
    kept = state.kept
    extra = {
        "grouping": plan.options.grouping.value,
        "retrieval_heads": kept.record() if kept else None,
        "calibration": state.stats.record if state.stats else None,
        "layers": state.layers,
        "refine": state.refine_record,
        "command": plan.command(),
        "torch_threads": _torch_threads(plan),  # the same bytes again need the same count (card: Reproduce)
        "device": plan.decided.device,  # where the parent ran (None: no stage ran it): GPU and CPU sums differ
        "decided": plan.decided.why or None,  # what the plan chose from the machine, and why (decide.py)
        "config": plan.config_values(),  # DST/convert.yaml's mapping; the card shows it
        "check": {k: v for k, v in state.checked.items() if k not in RUN_FACTS},
    }
    write_atomic(out_dir / config_file.CONFIG_NAME, config_file.render(extra["config"]))
    _write_provenance(plan, out_dir, extra)
    write_card(out_dir, plan.source, state.dst.name)  # README.md from mha2gqa.json; a source card moves aside


# ---- what the stages share ----


def _complete(state: RunState) -> None:
    """The rest of a loadable model beside the weights: SRC's tokenizer and other files, config.json; a per-layer
    child also its model code, so that stock transformers loads it with trust_remote_code=True (no mha2gqa)."""
    plan = state.plan
    copy_validated_files(plan.copied, plan.source, state.out_dir)
    config = target_config(plan)
    if config.get("model_type") == NEMOTRON_NAS:
        config.update(write_remote_code(state.out_dir, config))
    (state.out_dir / "config.json").write_text(jsontext.model_config(config, indent=2) + "\n")


def target_config(plan) -> dict:
    """DST's config.json: the source's at the counts (stock where every layer has the same count, else the
    Nemotron-NAS format: nemotron_nas/blocks.py), with --dtype's name."""
    written = dict(plan.config, dtype=plan.options.dtype) if plan.options.dtype else plan.config
    if is_uniform(plan.counts):
        return converted_config(written, plan.counts[0])
    return nemotron_nas_config(written, list(plan.counts))


def _torch_threads(plan) -> int | None:
    """torch's CPU thread count when a stage fitted weights to the calibration (its matrix products' float
    sums depend on it), else None: a merge alone gives the same bytes on any count, and on either executor."""
    if plan.torch_reason is None or not plan.options.calibration_shapes_weights:
        return None
    import torch

    return torch.get_num_threads()


def _write_tensors(plan, out_dir: Path, stats=None, computed: dict | None = None, kept=None) -> list:
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


def _merge_all(plan, stats, kept=None) -> tuple[dict, list[dict]]:
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


def _merge_layer(plan, step, stats, kept=None) -> tuple[dict, dict]:
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
    from mha2gqa.convert.casts import torch_range, validate_cast
    from mha2gqa.files.checkpoint import torch_dtypes

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


def _write_provenance(plan, out_dir: Path, extra: dict) -> None:
    """mha2gqa.json's conversion stage. Per-layer counts: `groups` is their mean (the KV bytes it prices are the
    sum over layers) and `kv_heads_per_layer` the counts themselves, with the format and the bytes per token."""
    source, options, tensors = plan.source, plan.options, plan.tensors
    counts, shape = plan.counts, plan.shape
    per_layer = {}
    if not is_uniform(counts):
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
