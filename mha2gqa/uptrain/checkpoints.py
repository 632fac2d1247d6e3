"""The output directory: resumable checkpoints (accelerate save_state + our progress.json; saved,
loaded, pruned to the last K), the checks that decide whether a run may start or resume there
(sources, room, damaged checkpoints), and how a failed write is worded.

A checkpoint counts only once its progress.json exists: it is written last, so a run killed
while saving leaves a folder that resume ignores.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

from mha2gqa.files import jsontext
from mha2gqa.files.reading import read_json
from mha2gqa.files.writing import nearest_existing, write_atomic
from mha2gqa.runtime.errors import InputError, first_line, is_user_fault, user_file_error
from mha2gqa.runtime.quiet import SHARED_TENSOR_NOISE, without_log_messages
from mha2gqa.runtime.units import counted
from mha2gqa.uptrain.recipe import RESUME_FREE_KEYS, Recipe

CHECKPOINTS = "checkpoints"
PROGRESS = "progress.json"
DAMAGED = "progress.damaged.json"  # a finished checkpoint that failed to load on --resume
FULL_BELOW = 2**20  # a write that failed with less free space than this failed for want of room
# Keys whose change would change the data order or the parameter set: a resume with them changed
# could not continue the same run. Other changes (optim.lr after a divergence, say) are reported.
STRICT_KEYS = (
    "model",
    "init_from_config",
    "tokenizer",
    "seed",
    "seq_len",
    "micro_batch_size",
    "grad_accum",
    "trainable",
    "data.",
    "budget.",
    "lora.",
)
# What a fresh run may delete in an existing output_dir when overwrite=true: only our own files, and
# never a previous final model (weights, config, tokenizer, mha2gqa.json): loop.save_final replaces that only
# once the new one is complete, so a run that fails leaves the old one whole.
OWN_FILES = ("checkpoints", "metrics.jsonl", "trace", "tensorboard")


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINTS / f"step-{step:08d}"


def complete_checkpoints(out: Path) -> list[Path]:
    """Finished checkpoints (a readable progress.json), oldest first."""
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if read_progress(p) is not None)


def read_progress(ckpt: Path) -> dict | None:
    """The checkpoint's progress record, or None when it is absent or damaged (not a finished checkpoint)."""
    try:
        progress = read_json(ckpt / PROGRESS, "it is damaged")
    except (OSError, InputError):
        return None
    return progress if isinstance(progress, dict) and isinstance(progress.get("step"), int) else None


def write_progress(ckpt: Path, progress: dict) -> None:
    write_atomic(ckpt / PROGRESS, jsontext.dumps(progress, indent=1))


def prune(out: Path, keep_last: int) -> None:
    for old in complete_checkpoints(out)[:-keep_last]:
        shutil.rmtree(old)


def save_checkpoint(accelerator, out: Path, progress: dict, keep_last: int) -> Path:
    """accelerate save_state (model, optimizer, RNG of every rank), then progress.json, which marks
    the checkpoint complete; older checkpoints beyond keep_last go. A disk that is full or read-only
    ends the run with one line (the previous checkpoints stay)."""
    ckpt = checkpoint_dir(out, progress["step"])
    if accelerator.is_main_process:
        (ckpt / PROGRESS).unlink(missing_ok=True)  # re-saving a step: incomplete until done
        (ckpt / DAMAGED).unlink(missing_ok=True)  # set aside by a --resume; replaced now
    accelerator.wait_for_everyone()
    try:
        with without_log_messages(SHARED_TENSOR_NOISE):  # tied embeddings are saved once, as they should be
            accelerator.save_state(str(ckpt))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_progress(ckpt, progress)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP while saving: no half checkpoint either
        if accelerator.is_main_process:
            shutil.rmtree(ckpt, ignore_errors=True)
        raise
    except Exception as err:  # noqa: BLE001 - torch.save and safetensors do not raise OSError for a full disk
        fault = write_failure(err, ckpt)
        if fault is None:
            raise
        if accelerator.is_main_process:
            shutil.rmtree(ckpt, ignore_errors=True)  # half a checkpoint is no checkpoint
        raise fault from err
    if accelerator.is_main_process:
        prune(out, keep_last)
    accelerator.wait_for_everyone()
    return ckpt


def saved_eval_loss(out: Path, step: int) -> float | None:
    """The eval loss the checkpoint a run resumes from was saved with (its bar for divergence)."""
    if step == 0:
        return None
    progress = read_progress(checkpoint_dir(out, step)) or {}
    value = progress.get("eval_loss")
    return value if isinstance(value, float) else None


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def validate_start(out: Path, recipe: Recipe, resume: bool, world_size: int) -> tuple[Path | None, list[str]]:
    """Decide, before anything is written, where the run starts. Returns (checkpoint to resume from or
    None, notes on changed keys the user should know about). Raises InputError when it may not start."""
    validate_not_a_source(out, recipe)
    if not resume:
        busy = out.is_dir() and any(out.iterdir())
        if busy and not recipe.overwrite:
            raise InputError(
                f"output_dir {out} is not empty: pass --resume to continue its run, overwrite=true to start "
                "over in it, or choose another output_dir"
            )
        return None, []
    found = complete_checkpoints(out)
    if not found:
        raise InputError(f"--resume: no finished checkpoint under {out / CHECKPOINTS}; run without --resume")
    progress = read_progress(found[-1])
    if progress["world_size"] != world_size:
        raise InputError(
            f"--resume: {found[-1]} was written by {progress['world_size']} processes, this run has {world_size}: "
            "launch with the same number (the data order depends on it)"
        )
    old, new = flat(progress["recipe"]), flat(recipe.to_dict())
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and k not in RESUME_FREE_KEYS]
    strict = [k for k in changed if k.startswith(STRICT_KEYS)]
    if strict:
        listed = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in strict)
        raise InputError(
            f"--resume: the recipe changed keys that fix the run's data and parameters ({listed}): "
            "restore them, or start a new output_dir"
        )
    return found[-1], [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed]


def clear_own_files(out: Path) -> None:
    """For overwrite=true: remove an earlier run's checkpoints and logs, leaving anything else alone."""
    for name in OWN_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def validate_not_a_source(out: Path, recipe: Recipe) -> None:
    """Refuse an output_dir that is, contains or lies inside a local directory the run reads from:
    overwrite=true and the final save would otherwise delete or replace the source's own files."""
    outs = _spellings(out)
    for key, value in (
        ("model", recipe.model),
        ("distill.teacher", recipe.distill.teacher),
        ("tokenizer", recipe.tokenizer),
        ("init_from_config", recipe.init_from_config),
    ):
        if value is None or not Path(value).expanduser().exists():
            continue  # a hub id: nothing local to protect
        for src in _spellings(Path(value)):
            src = src.parent if src.is_file() else src
            if any(o == src or src in o.parents for o in outs):
                raise InputError(
                    f"output_dir {out} is {key}={value} or lies inside it: the run would write over "
                    "its source; choose an output_dir outside it"
                )
            if any(o in src.parents for o in outs):
                raise InputError(
                    f"output_dir {out} contains {key}={value}: overwrite or the final save could "
                    "delete the source; choose an output_dir that does not hold it"
                )


def _spellings(path: Path) -> set[Path]:
    """The absolute path as written and with symlinks resolved: either may be how two paths meet."""
    path = path.expanduser()
    return {Path(os.path.abspath(path)), path.resolve()}


def truncate_jsonl(path: Path, keep) -> None:
    """Drop records a resumed run will write again (those past its checkpoint)."""
    if path.is_file():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and keep(json.loads(ln))]
        path.write_text("".join(ln + "\n" for ln in lines))


def load_newest_loadable(accelerator, out: Path) -> Path:
    """accelerator.load_state from the newest finished checkpoint that loads; a damaged one (a disk
    error, a file cut short) is set aside, said so, and the one before it is tried."""
    found = complete_checkpoints(out)
    for ckpt in reversed(found):
        try:
            accelerator.load_state(str(ckpt))
            return ckpt
        except Exception as err:  # noqa: BLE001 - whatever a damaged file raises (safetensors, pickle, torch)
            reason = first_line(err, default=type(err).__name__)
            if accelerator.is_main_process:  # no longer "finished": resume and pruning skip it from now on
                (ckpt / PROGRESS).replace(ckpt / DAMAGED)
            accelerator.print(
                f"note: checkpoint {ckpt} could not be loaded ({type(err).__name__}: {reason[:200]}); "
                f"its {PROGRESS} is now {DAMAGED}; trying the one before it"
            )
    raise InputError(
        f"--resume: none of the {counted(len(found), 'checkpoint')} under {out / CHECKPOINTS} could be loaded "
        "(see the notes above): start over with overwrite=true"
    )


def write_failure(err: Exception, path: Path) -> InputError | None:
    """An error raised while writing under `path`, as one line when the disk or its permissions are
    to blame; None when it is not (a bug: keep the traceback). torch.save reports a full disk as a
    RuntimeError ("unexpected pos") and safetensors as SafetensorError ("os error 28"), not OSError."""
    if isinstance(err, OSError):
        return user_file_error(err, path) if is_user_fault(err) else None
    code = re.search(r"os error (\d+)", str(err))
    if code:
        fault = OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path))
        return user_file_error(fault, path) if is_user_fault(fault) else None
    if shutil.disk_usage(nearest_existing(path)).free < FULL_BELOW:  # checked before the partial files are removed
        return user_file_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)), path)
    return None


def remove_unfinished(out: Path) -> None:
    """Remove checkpoint folders a killed run left half-written (no progress.json, not set aside as
    damaged): resume ignores them, and nothing else would ever delete them."""
    root = out / CHECKPOINTS
    for folder in root.glob("step-*") if root.is_dir() else ():
        if folder.is_dir() and not (folder / PROGRESS).exists() and not (folder / DAMAGED).exists():
            shutil.rmtree(folder, ignore_errors=True)
