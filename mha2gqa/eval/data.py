"""Held-out text for perplexity: local files (one document per file, or a folder of them) or a hub
dataset when online. The texts are joined with a blank line and tokenized once, as one stream, the
usual way sliding-window perplexity is reported (e.g. wikitext)."""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mha2gqa.errors import InputError
from mha2gqa.sources import hub_offline

TEXT_SUFFIXES = (".txt", ".md", ".text", ".txt.gz")
SEPARATOR = "\n\n"


@dataclass
class EvalText:
    """The token stream under evaluation, and what identifies it in a result file."""

    ids: torch.Tensor  # (N,) int64
    identity: dict = field(default_factory=dict)


def read_documents(data: str, config: str | None = None, split: str = "test", column: str = "text",
                   max_chars: int | None = None) -> tuple[list[str], dict]:
    """Documents from a file, a folder of text files, or a hub dataset name; and a description."""
    path = Path(data).expanduser()
    if path.is_file():
        return [_read_text(path)], {"source": "file", "path": str(path.resolve())}
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(TEXT_SUFFIXES))
        if not files:
            raise InputError(f"--data {data}: the folder has no {'/'.join(TEXT_SUFFIXES)} files: add text files")
        return [_read_text(p) for p in files], {"source": "folder", "path": str(path.resolve()), "files": len(files)}
    return _hub_documents(data, config, split, column, max_chars)


def _read_text(path: Path) -> str:
    try:
        # The embedded corpus ships gzip-compressed: read it as it is.
        data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        return data.decode("utf-8")
    except gzip.BadGzipFile as err:
        raise InputError(f"--data {path} ends in .gz but is not gzip: rename or re-compress it") from err
    except UnicodeDecodeError as err:
        raise InputError(f"--data {path} is not UTF-8 text (byte {err.start}): convert it to UTF-8") from err


def _hub_documents(name, config, split, column, max_chars):
    if hub_offline():
        raise InputError(
            f"--data {name}: not a local file or folder, and the hub is offline (HF_HUB_OFFLINE=1): "
            "pass a local text file or folder"
        )
    import datasets

    # Streaming reads only what is used: a c4 split is far larger than any eval needs.
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=max_chars is not None)
    except Exception as err:  # missing dataset/config/split or no network: all the user's to fix
        raise InputError(
            f"--data {name} (config {config}, split {split}) could not be loaded ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}): check the name, --data-config and --data-split"
        ) from err
    docs, chars = [], 0
    for row in ds:
        if column not in row:
            raise InputError(f"--data-column {column!r} is not in {name} (columns: {', '.join(row)})")
        docs.append(row[column])
        chars += len(row[column])
        if max_chars is not None and chars >= max_chars:
            break
    return docs, {"source": "hub", "name": name, "config": config, "split": split, "column": column}


def tokenize_documents(docs: list[str], tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """One stream of token ids, cut to `max_tokens` when given."""
    text = SEPARATOR.join(d for d in docs if d.strip())
    if not text:
        raise InputError("--data has no text (every document is empty): pass files with text in them")
    # verbose=False: the stream is longer than model_max_length on purpose; it is cut into windows.
    ids = tokenizer(text, add_special_tokens=True, return_attention_mask=False, verbose=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)
    return ids[:max_tokens] if max_tokens else ids


def load_eval_text(data: str, tokenizer, *, config=None, split="test", column="text",
                   max_tokens: int | None = None) -> EvalText:
    # A hub dataset read with a token budget stops early; no tokenizer averages 16 characters a token.
    max_chars = None if max_tokens is None else 16 * max_tokens
    docs, source = read_documents(data, config, split, column, max_chars)
    ids = tokenize_documents(docs, tokenizer, max_tokens)
    if ids.numel() < 2:
        raise InputError(f"--data {data} gives {ids.numel()} token(s): perplexity needs at least 2")
    identity = {
        **source,
        "documents": len(docs),
        "tokens": int(ids.numel()),
        "max_tokens": max_tokens,
        "text_sha256": hashlib.sha256(SEPARATOR.join(docs).encode("utf-8")).hexdigest(),
        # Two results compare only when they scored the same ids: hash those too.
        "ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
        "tokenizer": getattr(tokenizer, "name_or_path", None),
    }
    return EvalText(ids=ids, identity=identity)
