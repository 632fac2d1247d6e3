"""Where a model comes from: a local directory, or a hub id when online."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mha2gqa.errors import InputError

# What a conversion or an eval needs from a hub repo: never pickled weights.
MODEL_FILE_PATTERNS = ["*.safetensors", "*.json", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model_dir(src: str | os.PathLike) -> Path:
    """A local directory holding config.json, downloading `src` from the hub if it is a hub id."""
    path = Path(src).expanduser()
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):  # present but a FIFO or a link out: the reader says so
            raise InputError(f"{src} has no config.json: pass a Hugging Face model directory")
        return path
    if path.exists():
        raise InputError(f"{src} is a file: pass a model directory or a hub id like org/name")
    if not _HUB_ID.match(str(src)):
        raise InputError(f"{src}: no such directory, and not a hub id like org/name")
    if hub_offline():
        raise InputError(
            f"{src} is not a local directory and the hub is offline (HF_HUB_OFFLINE=1): "
            "download it first or pass a local path"
        )
    return Path(_download(str(src)))


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=MODEL_FILE_PATTERNS)
    except Exception as err:  # network, auth, missing repo: all are the user's to fix
        raise InputError(
            f"could not download {repo_id} from the hub ({type(err).__name__}): "
            "check the id, your network and HF_TOKEN, or pass a local directory"
        ) from err


def require_safetensors(model_dir: Path, what: str = "model") -> None:
    """Refuse a directory whose weights are pickle only: unpickling runs arbitrary code."""
    model_dir = Path(model_dir)
    if any(model_dir.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    found = f"only pickled weights ({', '.join(pickles[:3])})" if pickles else "no .safetensors weights"
    raise InputError(
        f"{what} {model_dir} has {found}: mha2gqa never unpickles files; re-save it as safetensors once, where you "
        'trust it: python -c "from transformers import AutoModelForCausalLM as M; '
        f"M.from_pretrained('{model_dir}').save_pretrained('{model_dir}-safetensors')\" and pass that directory"
    )
