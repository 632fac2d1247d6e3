"""The teacher's samples kept for the next run (data.train: [parent]).

Sampling is one forward of the teacher a token, on CPU most of a short run's cost, and it is deterministic:
two runs that distil different students from one parent with the same seed draw the same ids (a sweep of
starts, a longer run after a shorter one). So the blocks are kept in the cache (mha2gqa.files.cache.cache_dir()
/ samples, one safetensors file a draw) and read back instead of drawn again. The key is everything the
ids depend on: the teacher folder's fingerprint (config, tokenizer, weight files' headers, sizes,
modification times and bytes), the sampling record (recipe, chat header, seed, device), the teacher's dtype, the
count and length of the blocks, and torch's version. A teacher given as a hub id is not cached (its
files live in the hub's cache, whose snapshots the fingerprint does not follow). Best effort: a file that
cannot be read is drawn again, one that cannot be written costs the next run the sampling, nothing else.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from mha2gqa.corpus import sampling
from mha2gqa.files import jsontext
from mha2gqa.files.cache import cache_dir, update_with_model
from mha2gqa.files.writing import write_atomic
from mha2gqa.runtime.errors import InputError

CACHE_VERSION = 1  # bump when what a file holds or how the ids are drawn changes


def cached_blocks(teacher_dir: str | None, teacher, tokenizer, count: int, seq_len: int, seed: int, draw):
    """(count, seq_len) int32 blocks: read from the cache when this draw was made before, else drawn
    (`draw()`) and kept. Returns (blocks, whether they came from the cache)."""
    key = draw_key(teacher_dir, teacher, tokenizer, count, seq_len, seed)
    found = load(key) if key else None
    if found is not None and found.shape == (count, seq_len):
        return found, True
    blocks = draw()
    if key:
        save(key, blocks)
    return blocks, False


def draw_key(teacher_dir: str | None, teacher, tokenizer, count: int, seq_len: int, seed: int) -> str | None:
    """The cache key of a draw, or None when the teacher is no local folder."""
    folder = Path(teacher_dir).expanduser() if teacher_dir else None
    if folder is None or not folder.is_dir():
        return None
    record = sampling.sampling_record(teacher, tokenizer, seq_len, seed)
    dtype = str(next(teacher.parameters()).dtype)
    settings = {"v": CACHE_VERSION, "record": record, "dtype": dtype, "count": count, "seq_len": seq_len}
    settings["torch"] = torch.__version__
    digest = hashlib.sha256(jsontext.shown(settings, sort_keys=True).encode())
    update_with_model(digest, folder)
    return digest.hexdigest()


def path_of(key: str) -> Path:
    return cache_dir() / "samples" / f"{key}.safetensors"


def load(key: str) -> torch.Tensor | None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        path = path_of(key)
    except InputError:  # a MHA2GQA_CACHE that names no folder: drawn again, as when a file cannot be read
        return None
    if not path.is_file():
        return None
    try:
        return load_file(str(path))["ids"]
    except (SafetensorError, OSError, KeyError):  # a damaged file is drawn again, not trusted
        return None


def save(key: str, blocks: torch.Tensor) -> None:
    from safetensors.torch import save as to_bytes

    try:
        path_of(key).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path_of(key), to_bytes({"ids": blocks.to(torch.int32).contiguous()}))
    except (OSError, InputError):
        pass
