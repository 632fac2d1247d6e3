"""The refusals `uptrain` gives about its models and output_dir, as one torch-free set of functions that the run
(loop.py, models.py) and `uptrain --dry-run` both call, so that a dry run refuses what the run would refuse
(issue 55: a teacher of another vocabulary and an unwritable output_dir passed the dry run and failed the run).
The run calls them with what it loaded (config.vocab_size, the parameters it counts); the dry run with what the
configs and weight headers say (uptrain/plan.py), the same numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

from mha2gqa.files.cache import same_weights
from mha2gqa.files.writing import validate_room
from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain import checkpoints
from mha2gqa.uptrain.recipe import Recipe

ADAM_MOMENT_BYTES = 8  # AdamW's two fp32 moments per trained parameter
CHECKPOINT_WEIGHT_BYTES = 4  # a resumable checkpoint holds the weights in fp32


def validate_same_vocabulary(model_vocab: int, teacher_vocab: int) -> None:
    """KL compares whole next-token distributions: the model and distill.teacher need the same vocabulary."""
    if model_vocab != teacher_vocab:
        raise InputError(
            f"distill.teacher has vocab_size={teacher_vocab}, the model {model_vocab}: "
            "distil from the model's own parent (same tokenizer)"
        )


def validate_teacher_is_not_the_model(recipe: Recipe) -> None:
    """distill.teacher must be another model than the one trained: the same name, folder, hard-linked weights or a
    byte-identical copy (cache.same_weights) give a KL that starts at 0 and only pulls the model back to its start,
    not toward the parent whose behaviour a conversion lost. Local folders are compared; hub ids by name."""
    model, teacher = recipe.model, recipe.distill.teacher
    if model is None or teacher is None:
        return
    a, b = Path(model).expanduser(), Path(teacher).expanduser()
    if model == teacher:
        how = "the same name"
    elif not (a.is_dir() and b.is_dir()):
        return
    elif a.resolve() == b.resolve() or os.path.samefile(a, b):
        how = "the same folder"
    elif same_weights(a, b):
        how = "the same weights: hard links or a byte-identical copy"
    else:
        return
    raise InputError(
        f"distill.teacher {teacher} is the model itself ({how}): its KL starts at 0 and only pulls the model back to "
        "where it started; name the model's parent (the MHA model it was converted from: its mha2gqa.json gives "
        "the conversion's source), or leave distill.teacher unset"
    )


def disk_needed(parameters: int, trained: int, saved_bytes_per_parameter: float, saves: bool) -> int:
    """Disk a run needs at least: one resumable checkpoint (fp32 weights + AdamW's two fp32 moments of the
    trained ones) when it saves any, and the final model in its saved dtype."""
    checkpoint = CHECKPOINT_WEIGHT_BYTES * parameters + ADAM_MOMENT_BYTES * trained if saves else 0
    return int(checkpoint + parameters * saved_bytes_per_parameter)


def saves_checkpoints(recipe: Recipe) -> bool:
    return bool(recipe.save_every or recipe.exit_after_steps)


def validate_output_dir(recipe: Recipe, needed: int) -> None:
    """output_dir can take the run: its nearest existing folder is a writable folder with `needed` bytes free
    (read-only: every rank checks; a refusal on rank 0 alone would leave the others waiting)."""
    out = Path(recipe.output_dir).expanduser()
    validate_room(out, needed, f"output_dir {out}", "a checkpoint and the final model")


def validate_as_the_run_does(recipe: Recipe, resume: bool, student, teacher) -> None:
    """For `uptrain --dry-run` (one process, as `mha2gqa uptrain` runs): the run's refusals before its first
    write, in its order, from the sizes plan.py reads without loading (`student`, `teacher`: ModelSize, None
    for a hub model not in the cache, which the run judges once it is downloaded)."""
    checkpoints.validate_start(Path(recipe.output_dir).expanduser(), recipe, resume, world_size=1)
    validate_teacher_is_not_the_model(recipe)
    if student is not None and teacher is not None and student.vocab and teacher.vocab:  # 0: no vocab_size in
        validate_same_vocabulary(student.vocab, teacher.vocab)  # a config, whose class default the run reads
    if student is not None:
        saves = saves_checkpoints(recipe)
        validate_output_dir(recipe, disk_needed(student.parameters, student.trained, student.stored_bytes, saves))
