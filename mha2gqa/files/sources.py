"""Where a model comes from: a local directory, or a hub id when online.

The one hub-id rule of the package (`is_hub_id`, `model_ref_problem`, `snapshot_hub_id`): convert, inspect, eval and the
recipe checks all ask here, so a name is judged the same way everywhere.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from mha2gqa.files.reading import did_you_mean
from mha2gqa.runtime.errors import InputError

# What a conversion or an eval needs from a hub repo: never pickled weights.
MODEL_FILE_PATTERNS = ["*.safetensors", "*.json", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# The hub's own rule (huggingface_hub.utils.validate_repo_id): `name` or `org/name`, each part at most
# 96 of [A-Za-z0-9_.-], not starting or ending with '.' or '-', no '--' or '..', not ending in .git.
# Single-segment ids are real (gpt2, distilgpt2, bert-base-uncased).
_PART = r"[\w](?:[\w.\-]{0,94}[\w])?"
_HUB_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")
# One request to the hub waits at most this long (huggingface_hub's etag timeout), so an unreachable
# hub costs seconds, not minutes.
HUB_TIMEOUT_S = 10


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").upper() in {"1", "ON", "YES", "TRUE"}


def is_hub_id(name: str) -> bool:
    """`name` has the form of a hub repo id: `gpt2` or `org/name`."""
    name = str(name)
    return bool(_HUB_ID.match(name)) and "--" not in name and ".." not in name and not name.endswith(".git")


def looks_local(name: str) -> str | None:
    """Why a missing `name` is a local path the user mistyped rather than a hub id, or None: it starts
    like a path (/, ., ~), has more than one '/', or its first part is a folder here (runs/x with runs/)."""
    name = str(name)
    if name.startswith(("/", ".", "~")) or "\\" in name or name.endswith("/"):
        return "it is written as a local path"
    if name.count("/") > 1:
        return "a hub id has at most one '/' (org/name)"
    parent = name.split("/")[0] if "/" in name else ""
    if parent and Path(parent).is_dir():
        return f"{parent}/ is a local folder here"
    return None


def model_ref_problem(name: str, what: str = "") -> str | None:
    """What is wrong with `name` as a model directory or hub id, answered locally (no network), or
    None when it is a model directory or a hub id the hub may be asked for. `what` prefixes the
    message (a flag or recipe key, e.g. 'model=')."""
    label = f"{what}{name}"
    path = Path(name).expanduser()
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):  # a FIFO or a link out: the reader says so
            return f"{label} has no config.json: pass a Hugging Face model directory"
        return None
    if path.exists():
        return f"{label} is a file: pass a model directory or a hub id like gpt2 or org/name"
    local, near = looks_local(name), did_you_mean(name, "did you mean {}?")
    if local or not is_hub_id(name):
        why = "; ".join(filter(None, [local, near]))
        why = f" ({why})" if why else ""
        return f"{label}: no such directory{why}, and not a hub id like gpt2 or org/name"
    if hub_offline() and cached_snapshot(name) is None:
        return (
            f"{label} is not a local directory{f' ({near})' if near else ''} and the hub is offline (HF_HUB_OFFLINE=1), and the hub cache "
            f"({_cache_dir()}) holds no snapshot of it: download it first or pass a local path"
        )
    return None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def cached_snapshot(repo_id: str) -> Path | None:
    """The hub cache's snapshot of `repo_id` at its main revision, where its config.json is cached
    (HF_HUB_CACHE / HF_HOME, read as huggingface_hub reads them: refs/main -> snapshots/SHA, whose files
    link into blobs/), or None. This is how a cluster without internet runs a model it fetched before."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def snapshot_hub_id(path: str | None) -> str | None:
    """org/name of a model the hub cache resolved (…/models--org--name/snapshots/…), else None."""
    match = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", str(path or ""))
    return f"{match.group(1)}/{match.group(2)}" if match else None


def resolve_model_dir(src: str | os.PathLike) -> Path:
    """A local directory holding config.json: `src` itself, its snapshot in the hub cache when the hub
    is offline, else downloaded from the hub (a hub id)."""
    problem = model_ref_problem(str(src))
    if problem:
        raise InputError(problem)
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if hub_offline():
        return cached_snapshot(str(src))
    return Path(_download(str(src)))


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    # Said before it happens: a download can take a while, and an unreachable hub otherwise looks like a hang.
    print(
        f"fetching {repo_id} from the Hugging Face hub (safetensors, configs, tokenizer; {HUB_TIMEOUT_S} s "
        "timeout per request; HF_HUB_OFFLINE=1 uses local files only)",
        file=sys.stderr,
    )
    try:
        return snapshot_download(repo_id, allow_patterns=MODEL_FILE_PATTERNS, etag_timeout=HUB_TIMEOUT_S)
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
