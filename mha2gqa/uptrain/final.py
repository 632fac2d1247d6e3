"""The result of a run: a plain HF checkpoint (safetensors, config, tokenizer) in output_dir, and
mha2gqa.json: the source's lineage with this run's "uptrain" stage appended."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from mha2gqa import provenance


STAGING = ".final.partial"
WEIGHT_FILES = "model*.safetensors*"


def save_final(accelerator, model, tokenizer, out: Path, dtype: torch.dtype, finish=None) -> None:
    """Write the model (in the source checkpoint's dtype) and tokenizer, and whatever `finish(dir)`
    adds, into a folder beside output_dir's contents, then move them in: a previous final model in
    output_dir stays whole until the new one is complete. A full or read-only disk ends with one
    line and no half-written model. Every rank must call this: gathering an FSDP / ZeRO-3 state
    dict is collective."""
    from mha2gqa.uptrain.checkpoints import write_failure

    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        staging = out / STAGING
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
        try:
            # fp32 master weights -> the dtype the source was stored in (a bf16 7B stays 14 GB, not 28).
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(staging, state_dict=state, is_main_process=True)
            _set_config_dtype(staging / "config.json", dtype)
            tokenizer.save_pretrained(staging)
            if finish is not None:
                finish(staging)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: no half model left behind
            shutil.rmtree(staging, ignore_errors=True)
            raise
        except Exception as err:  # noqa: BLE001 - safetensors reports a full disk as SafetensorError
            fault = write_failure(err, out)
            shutil.rmtree(staging, ignore_errors=True)
            if fault is None:
                raise
            raise fault from err
        _swap_in(staging, out)
    accelerator.wait_for_everyone()


def _swap_in(staging: Path, out: Path) -> None:
    """Move every file of `staging` into `out` (each rename atomic: same filesystem), weights first,
    mha2gqa.json last; then drop old weight shards that the new model does not have."""
    new = sorted(staging.iterdir(), key=lambda p: (not p.match(WEIGHT_FILES), p.name == provenance.FILE_NAME, p.name))
    for path in new:
        os.replace(path, out / path.name)
    names = {p.name for p in new}
    for old in out.glob(WEIGHT_FILES):
        if old.name not in names:
            old.unlink()
    staging.rmdir()


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """save_pretrained records the in-memory (fp32) dtype; record the one the weights were saved in."""
    config = json.loads(path.read_text())
    config["dtype"] = str(dtype).replace("torch.", "")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_provenance(out: Path, source_dir: Path | None, record: dict) -> dict:
    """OUT/mha2gqa.json: the source's lineage (none for a model trained from scratch) plus this run's
    "uptrain" stage; see `mha2gqa.provenance` for the schema."""
    return provenance.append(out, "uptrain", record, source=source_dir)
