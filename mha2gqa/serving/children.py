"""What makes each CHILD of serve-bench a model to compare with PARENT: a folder of its own (not the parent again,
by a link or another spelling of its path), weights of its own (not hard links to the parent's, nor a byte-identical
copy of them: cache.same_weights), and the parent's tokenizer, so that every engine and transformers see the same
ids. Torch-free: read before any server starts.

A tokenizer is judged by what fixes its ids, not by its files' bytes or by vocab_size alone: two tokenizers of
one size can number their tokens differently, and a tokenizer saved again by transformers (uptrain's final
model) holds the same content in other bytes. So each file that defines ids is read into a comparable value:
tokenizer.json as parsed JSON without its truncation and padding settings, vocab.json and added_tokens.json as
parsed JSON, the added tokens of tokenizer_config.json, and the bytes of tokenizer.model, merges.txt and
vocab.txt.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mha2gqa.files.cache import same_weights
from mha2gqa.files.reading import read_bytes, read_json
from mha2gqa.runtime.errors import InputError

_PARSED = ("tokenizer.json", "vocab.json", "added_tokens.json")
_BYTES = ("tokenizer.model", "merges.txt", "vocab.txt")
_RUN_SETTINGS = ("truncation", "padding")  # in tokenizer.json: how a call pads and cuts, not which ids it gives
_MAX_TOKENIZER_BYTES = 1 << 30  # the largest real tokenizer.json files are tens of MB
_FIX = "serve-bench compares conversions of one parent, which keep its tokenizer"
_FILE_FIX = "a model's tokenizer files must be readable JSON: copy them from the parent"


def tokenizer_identity(folder: Path) -> dict[str, object]:
    """{file name: what in it fixes the ids} for each tokenizer file of `folder` that defines ids."""
    found: dict[str, object] = {}
    for name in _PARSED:
        if (folder / name).is_file():
            value = read_json(folder / name, _FILE_FIX, _MAX_TOKENIZER_BYTES, root=folder)
            if name == "tokenizer.json" and isinstance(value, dict):
                value = {k: v for k, v in value.items() if k not in _RUN_SETTINGS}
            found[name] = value
    for name in _BYTES:
        if (folder / name).is_file():
            found[name] = hashlib.sha256(
                read_bytes(folder / name, _MAX_TOKENIZER_BYTES, folder, name, _FILE_FIX)
            ).hexdigest()
    config = folder / "tokenizer_config.json"
    if config.is_file():
        added = read_json(config, _FILE_FIX, root=folder)
        if isinstance(added, dict) and added.get("added_tokens_decoder"):
            found["tokenizer_config.json's added_tokens_decoder"] = added["added_tokens_decoder"]
    return found


def validate_children(parent: Path, children: list[Path], arguments: list[str]) -> None:
    """Refuse a child that is the parent's folder (or another child's), or whose tokenizer differs from the
    parent's; `arguments` are the paths as the user typed them, parent first, for the message."""
    folders = [parent, *children]
    for i, folder in enumerate(folders[1:], start=1):
        for j in range(i):
            if _same_folder(folder, folders[j]):
                what = "PARENT" if j == 0 else f"CHILD {arguments[j]}"
                raise InputError(
                    f"CHILD {arguments[i]} is the same folder as {what} ({folders[j]}): serve-bench compares a parent "
                    "with its conversions, each a folder of its own; pass the converted model's folder"
                )
    for folder, typed in zip(children, arguments[1:]):
        if same_weights(parent, folder):
            raise InputError(
                f"CHILD {typed} holds PARENT's weights (its safetensors are the parent's files, hard-linked or "
                "copied byte for byte): serve-bench compares a parent with its conversions; pass the converted "
                "model's folder"
            )
    mine = tokenizer_identity(parent)
    for folder, typed in zip(children, arguments[1:]):
        theirs = tokenizer_identity(folder)
        if theirs != mine:
            raise InputError(f"CHILD {typed}: {_difference(mine, theirs)}: {_FIX}")


def _same_folder(a: Path, b: Path) -> bool:
    """One folder by any path to it: resolved links, or the same inode (a bind mount, another spelling)."""
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:
        return False


def _difference(parent: dict, child: dict) -> str:
    """The first tokenizer file in which a child's ids differ from its parent's, in words."""
    if not child:
        return f"has no tokenizer files, its parent has {', '.join(parent)}"
    if not parent:
        return f"has tokenizer files ({', '.join(child)}), its parent none"
    for name in [*parent, *(n for n in child if n not in parent)]:
        if name not in child:
            return f"has no {name}, its parent has one"
        if name not in parent:
            return f"has {name}, its parent has none"
        if parent[name] != child[name]:
            return f"its {name} numbers tokens differently from its parent's (another tokenizer)"
    return "its tokenizer differs from its parent's"
