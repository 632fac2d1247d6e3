"""The uptraining run, read top to bottom like accelerate's nlp_example: set up (everything that can
fail on bad input happens before the first file is written), train (steps.py), save the result: a
plain HF checkpoint (safetensors, config, tokenizer) in output_dir, and mha2gqa.json: the source's
lineage with this run's "uptrain" stage appended."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.estimates import STORED, for_this_machine
from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.estimates.stages import UPTRAIN
from mha2gqa.files import jsontext
from mha2gqa.files.writing import swap_in, write_atomic
from mha2gqa.records import provenance
from mha2gqa.records.card import write_card
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.quiet import without_transformers_bars
from mha2gqa.uptrain import allocator, checkpoints, lora, mixed_data
from mha2gqa.uptrain.data import TrainData
from mha2gqa.uptrain.guard import TrainingDiverged
from mha2gqa.uptrain.models import (
    Student,
    load_student,
    load_teacher,
    load_tokenizer,
    make_optimizer,
    save_bytes,
    select_trainable,
    validate_positions,
    validate_teacher,
    validate_vocab,
)
from mha2gqa.uptrain.plan import tokens_per_step, total_steps, uptrain_estimate
from mha2gqa.uptrain.preflight import saves_checkpoints, validate_output_dir, validate_teacher_is_not_the_model
from mha2gqa.uptrain.probe_evals import ProbeEvals
from mha2gqa.uptrain.recipe import Recipe
from mha2gqa.uptrain.recipe_load import recorded
from mha2gqa.uptrain.reporting import Metrics, Trace
from mha2gqa.uptrain.steps import Run, run_steps

__all__ = ["TrainingDiverged", "train"]


def train(recipe: Recipe, resume: bool = False, clock=NO_CLOCK) -> Path:
    """Train as the recipe says; returns output_dir, which holds the final HF checkpoint once the
    budget is spent (a run stopped by exit_after_steps leaves only a resumable checkpoint there).

    Works in a plain process (one rank) and under `accelerate launch` (every rank calls it).
    Raises InputError for bad input (nothing written) and TrainingDiverged on a NaN/inf loss. clock: an
    estimates Clock that says the run's estimate before the models are loaded and times its stages (the CLI's)."""
    out = Path(recipe.output_dir).expanduser()
    accelerator = _make_accelerator(recipe, out)
    # The machine is probed before the allocator change, by the one process that says the estimate: with every block
    # of 1 MiB or more mapped afresh, the probe's products read 1.2-1.4x slower than the machine is (the rates'
    # training stages ran with the change).
    says = clock is not NO_CLOCK and accelerator.is_main_process
    try:
        estimate = _estimate_here(recipe, accelerator.num_processes) if says else None
        allocator.return_freed_memory()  # else the heap keeps every step's freed activations (allocator.py)
        return _train(recipe, resume, out, accelerator, clock, estimate)
    finally:
        _release(accelerator)


def _make_accelerator(recipe: Recipe, out: Path):
    from accelerate import Accelerator
    from accelerate.utils import is_tensorboard_available

    log_with = "tensorboard" if recipe.tensorboard and is_tensorboard_available() else None
    try:
        return Accelerator(
            gradient_accumulation_steps=recipe.grad_accum,
            mixed_precision=recipe.mixed_precision,
            log_with=log_with,
            project_dir=str(out),
        )
    except ValueError as err:
        if "already been initialized" in str(err):  # accelerate fixes mixed precision for a process's life
            raise InputError(
                f"mixed_precision={recipe.mixed_precision}: this Python process already trained with "
                "another mixed_precision, which accelerate keeps until the process ends: run this "
                "training in a process of its own (mha2gqa uptrain --recipe ...)"
            ) from err
        raise InputError(
            f"mixed_precision={recipe.mixed_precision} is not usable here ({err}): use no or bf16"
        ) from err


def _release(accelerator) -> None:
    """End trackers and the process group, and drop the accelerator's references to the model and
    optimizer (public API only). A later train() in the same process works as long as it keeps the
    same mixed_precision; accelerate allows no other (see _make_accelerator)."""
    accelerator.end_training()
    accelerator.free_memory()


@dataclass
class _Loaded:
    """What a run trains and reads, loaded and checked before anything is written."""

    tokenizer: object
    student: Student
    data: TrainData
    teacher: torch.nn.Module | None
    trainable: int  # parameters the run trains


def _estimate_here(recipe: Recipe, world: int):
    """The run's estimate at the stored rates, scaled to this machine when it is long enough to be worth a probe
    (estimates.for_this_machine); None where the sizes are unknown."""
    priced = uptrain_estimate(recipe, world, STORED)
    return None if priced is None else for_this_machine(priced, "torch")


def _train(recipe: Recipe, resume: bool, out: Path, accelerator, clock=NO_CLOCK, estimate=None) -> Path:
    from accelerate.utils import set_seed

    world, rank = accelerator.num_processes, accelerator.process_index
    total = total_steps(recipe, world)
    start_ckpt, changed = checkpoints.validate_start(out, recipe, resume, world)
    if not accelerator.is_main_process:
        clock = NO_CLOCK  # one process says the estimate

    def ready(student: Student) -> None:  # every refusal the models and output_dir can give is behind
        _validate_output_room(recipe, out, student)
        clock.begin(lambda: estimate)

    set_seed(recipe.seed)
    loaded = _load(recipe, accelerator, ready)
    model, optimizer = _prepare(recipe, accelerator, loaded.student)
    _open_output(recipe, resume, out, accelerator, loaded.student)
    start = 0
    if start_ckpt is not None:
        start_ckpt = checkpoints.load_newest_loadable(accelerator, out)
        start = checkpoints.read_progress(start_ckpt)["step"]
        accelerator.print(f"resuming from {start_ckpt} (step {start} of {total})")
        for note in changed:
            accelerator.print(f"note: recipe key changed since the checkpoint: {note}")
    if accelerator.log_with:
        accelerator.init_trackers("tensorboard", config=_scalar_config(recipe))

    metrics = Metrics(out, accelerator, start if start_ckpt else -1, total, bool(accelerator.log_with))
    trace = Trace(out, rank, start * recipe.grad_accum) if recipe.trace_samples else None
    probes = _probes(recipe, loaded, accelerator.device)
    run = Run(
        recipe, accelerator, model, optimizer, loaded.teacher, loaded.data, out, total, metrics, trace, clock, probes
    )
    clock.stage(UPTRAIN.train.name)
    try:
        final_evals = run_steps(run, start)
    finally:
        metrics.close()
    if final_evals is None:
        accelerator.print(f"stopped after exit_after_steps={recipe.exit_after_steps}: continue with --resume")
        return out
    if trace is not None:
        trace.finish(accelerator.unwrap_model(model))
    record = _run_record(recipe, loaded, total, world, start if start_ckpt else None, final_evals)
    # What the weights depend on beside the recipe, chosen from the machine (a busy machine gives a small model one
    # thread: threads.py): float sums differ with torch's thread count and between a GPU and the CPU (card: Reproduce).
    record |= {"torch_threads": torch.get_num_threads(), "device": str(accelerator.device)}
    clock.stage(UPTRAIN.save.name)
    _save(recipe, accelerator, model, loaded, out, record)
    clock.finish()
    return out


def _load(recipe: Recipe, accelerator, ready=lambda student: None) -> _Loaded:
    """The tokenizer, the student (with its LoRA adapters), the data and the teacher, each checked against
    the others: a bad input fails here, before the first file is written. `ready(student)` runs once the models
    are loaded and checked, before the data is read or sampled (the run's estimate is said there)."""
    tokenizer = load_tokenizer(recipe.tokenizer_source)
    student = load_student(recipe)
    # the teacher is loaded and checked before the data: data.train parent samples it, and a broken one is refused
    # before the run says its estimate
    teacher = _teacher(recipe, accelerator, student) if recipe.distill.teacher else None
    validate_positions(student.model, recipe.seq_len)
    ready(student)
    data = _data(recipe, accelerator, tokenizer, teacher)
    validate_vocab(student.model, data.eval)
    if student.source_dir is not None:  # a broken source mha2gqa.json fails now, not after training
        provenance.lineage(student.source_dir)
    if recipe.trainable == "lora":
        student.model = lora.add_adapters(student.model, recipe.lora)
    trainable = select_trainable(student.model, recipe.trainable)
    return _Loaded(tokenizer, student, data, teacher, trainable)


def _probes(recipe: Recipe, loaded: _Loaded, device) -> ProbeEvals:
    """eval_retrieval's questions and eval_domains' blocks, and the teacher's numbers on them (once)."""
    positions = getattr(loaded.student.model.config, "max_position_embeddings", None)
    probes = ProbeEvals(recipe.eval_retrieval, recipe.eval_domains, loaded.tokenizer, recipe.seq_len, positions)
    if probes and loaded.teacher is not None:
        probes.set_reference(loaded.teacher, device)
    return probes


def _teacher(recipe: Recipe, accelerator, student: Student) -> torch.nn.Module:
    validate_teacher_is_not_the_model(recipe)  # preflight's rule, as --dry-run applies it
    teacher = load_teacher(recipe, accelerator.device)
    validate_teacher(student.model, teacher)
    return teacher


def _data(recipe: Recipe, accelerator, tokenizer, teacher) -> TrainData:
    """The run's data (rank 0 reads text first and fills the datasets cache; the others then read it).
    A mix or the teacher's samples come with a record: every process's, gathered, then shown."""
    rank, world = accelerator.process_index, accelerator.num_processes
    show = accelerator.is_local_main_process
    data = mixed_data.build(recipe, tokenizer, rank, world, show, teacher, accelerator.main_process_first)
    if data.record is not None:
        if world > 1:  # each process drew its own samples: the record names the seed and sha256 of each
            from accelerate.utils import gather_object

            data.record = mixed_data.merge_records(gather_object([data.record]))
        accelerator.print(mixed_data.describe(data.record))
    return data


def _prepare(recipe: Recipe, accelerator, student: Student):
    """The model and its optimizer, handed to accelerate (wrapped for DDP / FSDP, moved to the device)."""
    if recipe.gradient_checkpointing:
        # transformers 5.x renamed it (the old name warns); earlier 5.x releases have only the old one
        enable = getattr(student.model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            student.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = make_optimizer(student.model, recipe.optim, accelerator.device.type)
    model, optimizer = accelerator.prepare(student.model, optimizer)
    if accelerator.gradient_accumulation_steps != recipe.grad_accum:  # a launch config can override it
        raise InputError(
            f"the accelerate config sets gradient accumulation to {accelerator.gradient_accumulation_steps} but the "
            f"recipe has grad_accum={recipe.grad_accum}: remove it from the accelerate config (the recipe rules)"
        )
    return model, optimizer


def _validate_output_room(recipe: Recipe, out: Path, student: Student) -> None:
    """output_dir holds a checkpoint and the final model (every rank checks, read-only: a refusal on rank 0 alone
    would leave the others waiting)."""
    validate_output_dir(recipe, save_bytes(student.model, student.saved_dtype, saves_checkpoints(recipe)))


def _open_output(recipe: Recipe, resume: bool, out: Path, accelerator, student: Student) -> None:
    """Check output_dir's room, then (the first write of the run) clear or create it."""
    _validate_output_room(recipe, out, student)

    # Nothing was written before this point: every input error above left output_dir untouched.
    if accelerator.is_main_process:
        if recipe.overwrite and not resume:
            checkpoints.clear_own_files(out)
        out.mkdir(parents=True, exist_ok=True)
        checkpoints.remove_unfinished(out)  # debris of a run killed while saving
    accelerator.wait_for_everyone()


def _run_record(recipe: Recipe, loaded: _Loaded, total: int, world: int, resumed: int | None, evals: dict) -> dict:
    """This run's "uptrain" stage in mha2gqa.json."""
    student = loaded.student
    return {
        "recipe": recorded(recipe),  # local paths absolute: the record reads the same from anywhere
        "source": {
            "model": recipe.model,
            "model_dir": str(student.source_dir) if student.source_dir else None,
            "init_from_config": recipe.init_from_config,
            "tokenizer": recipe.tokenizer_source,
            "teacher": recipe.distill.teacher,
        },
        "steps": total,
        "tokens_seen": total * tokens_per_step(recipe, world),
        "tokens_per_step": tokens_per_step(recipe, world),
        "world_size": world,
        "trainable_params": loaded.trainable,
        "saved_dtype": str(student.saved_dtype).replace("torch.", ""),
        "resumed_from_step": resumed,
        **({"data": loaded.data.record} if loaded.data.record is not None else {}),
        **{f"final_{k}": v for k, v in evals.items()},
    }


def _save(recipe: Recipe, accelerator, model, loaded: _Loaded, out: Path, record: dict) -> None:
    """The final model (LoRA adapters merged in first), its mha2gqa.json and card."""
    student = loaded.student
    if recipe.trainable == "lora":  # every rank merges its own (identical) replica: no gathering needed
        record["adapter"] = lora.adapter_record(accelerator.unwrap_model(model), recipe.lora)
        model = lora.merged_model(accelerator.unwrap_model(model), recipe.lora, student.source_dir, student.saved_dtype)
    # mha2gqa.json and the card made from it are written with the model and moved in with it.
    save_final(
        accelerator,
        model,
        loaded.tokenizer,
        out,
        student.saved_dtype,
        finish=lambda staging: _record(staging, student.source_dir, record, out.name),
    )


def _record(staging: Path, source_dir: Path | None, record: dict, name: str) -> None:
    """mha2gqa.json (the source's lineage, none for a model trained from scratch, plus this run's
    "uptrain" stage; see `mha2gqa.records.provenance`) and the model card made from it."""
    provenance.append(staging, "uptrain", record, source=source_dir)
    write_card(staging, source_dir, name)


def _scalar_config(recipe: Recipe) -> dict:
    """Tensorboard hparams take scalars only."""
    flat = checkpoints.flat(recipe.to_dict())
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}


# ---- the final model ----

STAGING = ".final.partial"
WEIGHT_FILES = "model*.safetensors*"


def save_final(accelerator, model, tokenizer, out: Path, dtype: torch.dtype, finish=None) -> None:
    """Write the model (in the source checkpoint's dtype) and tokenizer, and whatever `finish(dir)`
    adds, into a folder beside output_dir's contents, then move them in: a previous final model in
    output_dir stays whole until the new one is complete. A full or read-only disk ends with one
    line and no half-written model. Every rank must call this: gathering an FSDP / ZeRO-3 state
    dict is collective."""
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        staging = out / STAGING
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
        try:
            # fp32 master weights -> the dtype the source was stored in (a bf16 7B stays 14 GB, not 28).
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            unwrapped = accelerator.unwrap_model(model)
            with without_transformers_bars():  # its "Writing model shards" bar beside ours: one bar a stage
                unwrapped.save_pretrained(staging, state_dict=state, is_main_process=True)
            _set_config_dtype(staging / "config.json", dtype)
            tokenizer.save_pretrained(staging)
            if finish is not None:
                finish(staging)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: no half model left behind
            shutil.rmtree(staging, ignore_errors=True)
            raise
        except Exception as err:  # noqa: BLE001 - safetensors reports a full disk as SafetensorError
            fault = checkpoints.write_failure(err, out)
            shutil.rmtree(staging, ignore_errors=True)
            if fault is None:
                raise
            raise fault from err
        # every file renamed into output_dir (atomic each): weights first, mha2gqa.json last
        swap_in(staging, out, files_first=WEIGHT_FILES, files_last=(provenance.FILE_NAME,))
    accelerator.wait_for_everyone()


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """save_pretrained records the in-memory (fp32) dtype; record the one the weights were saved in."""
    config = json.loads(path.read_text())
    config["dtype"] = str(dtype).replace("torch.", "")
    write_atomic(path, jsontext.model_config(config, indent=2, sort_keys=True) + "\n")
