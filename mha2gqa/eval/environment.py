"""Where and how a result was measured, beside its numbers: the model's role, the machine, the versions. (What
made the model is mha2gqa.records.provenance's: its mha2gqa.json.)"""

from __future__ import annotations

import platform

import torch

from mha2gqa.records import provenance
from mha2gqa.runtime.errors import InputError


def infer_role(record: dict | None, role: str | None = None) -> str:
    """--role when given, else the role the model's mha2gqa.json records (`mha2gqa.records.provenance.role_of`)."""
    if role is not None:
        if role not in provenance.ROLES:
            raise InputError(f"--role {role!r} is not a role (use {', '.join(provenance.ROLES)})")
        return role
    return provenance.role_of(record)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def versions() -> dict:
    import transformers

    from mha2gqa.version import __version__

    return {
        "mha2gqa": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    }
