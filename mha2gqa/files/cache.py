"""The user's cache of numbers worth not computing twice (the parent's check scores, the parent's samples):
where it sits, and the fingerprint of a model folder that keys it.

The cache sits in MHA2GQA_CACHE (else $XDG_CACHE_HOME/mha2gqa, else ~/.cache/mha2gqa). Each user keeps its
own subfolder and file format (safetensors: never pickle) and checks what it reads: a cache file that cannot
be read, written or trusted only costs the work again. A MHA2GQA_CACHE that names no folder at all (`~nosuchuser/c`)
is an InputError naming the variable.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mha2gqa.runtime.errors import InputError

FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
HEADER_LIMIT = 100 << 20  # a safetensors header this long or longer is read only up to here
# A weight file's bytes are hashed whole up to WHOLE_BYTES, else SAMPLES evenly spaced chunks of SAMPLE_BYTES: a
# file replaced by another of the same size and modification time (a copy with `cp -p`, `touch -r`) changes
# the key. Cost measured in docs/convert.md (the check section): a few ms a model, against seconds for its check.
WHOLE_BYTES = 8 << 20
SAMPLES, SAMPLE_BYTES = 32, 256 << 10


def model_key(folder: Path) -> str:
    """A short key of a model folder alone (update_with_model): the prefix of every cache file made from it, so
    that a plan that cannot tokenize (convert's torch-free prepare) can ask whether the cache holds its numbers."""
    return model_digest(folder)[:16]


def model_digest(folder: Path) -> str:
    """The sha256 hex digest of update_with_model(folder): one pass over its files for a key that needs it whole."""
    digest = hashlib.sha256()
    update_with_model(digest, folder)
    return digest.hexdigest()


def cache_dir() -> Path:
    root = os.environ.get("MHA2GQA_CACHE")
    if root:
        try:
            return Path(root).expanduser()
        except RuntimeError as err:  # `~nosuchuser/c`: a home that does not exist
            raise InputError(
                f"MHA2GQA_CACHE={root} is not a usable folder ({err}): set it to a folder you can write, or unset it"
            ) from err
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mha2gqa"


def update_with_model(digest, folder: Path) -> None:
    """Feed `digest` (a hashlib object) what a model folder's outputs depend on: its config and tokenizer
    files whole, and each weight file's name, size, modification time, safetensors header and bytes (whole
    when small, else sampled: a changed file changes the fingerprint without reading its gigabytes)."""
    for path in sorted(Path(folder).iterdir()):
        if path.name in FINGERPRINT_FILES:
            digest.update(path.name.encode() + path.read_bytes())
        elif path.suffix == ".safetensors" and path.is_file():
            stat = path.stat()
            with open(path, "rb") as f:
                head = f.read(8)
                digest.update(f"{path.name} {stat.st_size} {stat.st_mtime_ns}".encode() + head)
                digest.update(f.read(min(int.from_bytes(head, "little"), HEADER_LIMIT)))
                _update_with_bytes(digest, f, stat.st_size)


def _update_with_bytes(digest, f, size: int) -> None:
    """The file's bytes whole up to WHOLE_BYTES, else SAMPLES chunks from its start to its end."""
    if size <= WHOLE_BYTES:
        f.seek(0)
        while chunk := f.read(SAMPLE_BYTES):
            digest.update(chunk)
        return
    for i in range(SAMPLES):
        f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
        digest.update(f.read(SAMPLE_BYTES))


def same_weights(a: Path, b: Path) -> bool:
    """Folder `b`'s safetensors are folder `a`'s: the same names, each the same inode (a hard link) or the same
    bytes (a copy). Hashed whole only where every name and size match: a conversion changes the k/v shapes, so a
    real child is told apart by its sizes without reading a byte (serve-bench's children, uptrain's teacher)."""
    mine = {p.name: p for p in sorted(Path(a).glob("*.safetensors")) if p.is_file()}
    theirs = {p.name: p for p in sorted(Path(b).glob("*.safetensors")) if p.is_file()}
    if not mine or theirs.keys() != mine.keys():
        return False
    if any(theirs[name].stat().st_size != mine[name].stat().st_size for name in mine):
        return False
    return all(os.path.samefile(mine[n], theirs[n]) or _file_digest(mine[n]) == _file_digest(theirs[n]) for n in mine)


def _file_digest(path: Path) -> str:
    """sha256 of a whole file, read in 16 MiB pieces (memory flat at any size)."""
    found = hashlib.sha256()
    with open(path, "rb") as handle:
        while piece := handle.read(1 << 24):
            found.update(piece)
    return found.hexdigest()
