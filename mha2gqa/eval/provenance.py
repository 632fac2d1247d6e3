"""What a result was measured on: the model's role and label, its shape, the machine, the versions."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from mha2gqa.errors import InputError

ROLES = ("parent", "converted", "uptrained")
PROVENANCE_FILE = "mha2gqa.json"


def read_provenance(model_dir: Path) -> dict | None:
    """The model dir's mha2gqa.json (written by convert/uptrain), or None when there is none."""
    path = Path(model_dir) / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"{path} is not valid JSON ({err.msg}): pass --role to say what this model is") from err
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object: pass --role to say what this model is")
    return data


def infer_role(provenance: dict | None, role: str | None = None) -> str:
    """--role when given; else from the provenance: a conversion record makes a model converted, or
    uptrained when it was trained after the conversion; a model without a conversion record (no file,
    or one that records only its pretraining, like the embedded default) is a parent."""
    if role is not None:
        if role not in ROLES:
            raise InputError(f"--role {role!r} is not a role (use {', '.join(ROLES)})")
        return role
    if provenance is None or "conversion" not in provenance:
        return "parent"
    return "uptrained" if "uptrain" in provenance else "converted"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def versions() -> dict:
    import transformers

    import mha2gqa

    return {
        "mha2gqa": mha2gqa.__version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    }
