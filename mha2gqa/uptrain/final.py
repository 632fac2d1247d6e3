"""The result of a run: a plain HF checkpoint (safetensors, config, tokenizer) in output_dir, and
mha2gqa.json: the source's lineage with this run's "uptrain" stage appended."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mha2gqa import provenance


def save_final(accelerator, model, tokenizer, out: Path, dtype: torch.dtype) -> None:
    """Write the model (in the source checkpoint's dtype) and tokenizer. Every rank must call this:
    gathering an FSDP / ZeRO-3 state dict is collective."""
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        # fp32 master weights -> the dtype the source was stored in (a bf16 7B stays 14 GB, not 28).
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(out, state_dict=state, is_main_process=True)
        _set_config_dtype(out / "config.json", dtype)
        tokenizer.save_pretrained(out)
    accelerator.wait_for_everyone()


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """save_pretrained records the in-memory (fp32) dtype; record the one the weights were saved in."""
    config = json.loads(path.read_text())
    config["dtype"] = str(dtype).replace("torch.", "")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_provenance(out: Path, source_dir: Path | None, record: dict) -> dict:
    """OUT/mha2gqa.json: the source's lineage (none for a model trained from scratch) plus this run's
    "uptrain" stage; see `mha2gqa.provenance` for the schema."""
    return provenance.append(out, "uptrain", record, source=source_dir)
