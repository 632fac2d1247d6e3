"""Held-out text for perplexity: the documents of files, a folder or a hub dataset (read by
mha2gqa.corpus.textdata), joined with a blank line and tokenized once, as one stream, the usual way
sliding-window perplexity is reported (e.g. wikitext): corpus/tokens.py's stream_ids."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mha2gqa.corpus import textdata
from mha2gqa.corpus.tokens import SEPARATOR, joined, stream_ids
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.units import counted


@dataclass
class EvalText:
    """The token stream under evaluation, and what identifies it in a result file."""

    ids: torch.Tensor  # (N,) int64
    identity: dict = field(default_factory=dict)


def read_documents(
    data: str, config: str | None = None, split: str = "test", column: str = "text", max_chars: int | None = None
) -> tuple[list[str], dict]:
    """Documents from a file, a folder of files, or a hub dataset name; and a description. A hub
    dataset is read only until `max_chars` characters (local files are read whole)."""
    source = textdata.resolve("--data", data)
    if source.hub is not None:
        docs, chars = [], 0
        for doc in textdata.iter_texts(source, column, hub_config=config, hub_split=split):
            docs.append(doc)
            chars += len(doc)
            if max_chars is not None and chars >= max_chars:
                break
        return docs, {"source": "hub", "name": source.hub, "config": config, "split": split, "column": column}
    docs = list(textdata.iter_texts(source, column))
    if source.folder:
        return docs, {"source": "folder", "path": str(Path(data).expanduser().resolve()), "files": len(source.files)}
    return docs, {"source": "file", "path": str(source.files[0].resolve())}


def tokenize_documents(docs: list[str], tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """One stream of token ids, cut to `max_tokens` when given."""
    text = joined(docs)
    if not text:
        raise InputError("--data has no text (every document is empty): pass files with text in them")
    return stream_ids(text, tokenizer, max_tokens or None)


def load_eval_text(
    data: str, tokenizer, *, config=None, split="test", column="text", max_tokens: int | None = None
) -> EvalText:
    # A hub dataset read with a token budget stops early; no tokenizer averages 16 characters a token.
    max_chars = None if max_tokens is None else 16 * max_tokens
    docs, source = read_documents(data, config, split, column, max_chars)
    ids = tokenize_documents(docs, tokenizer, max_tokens)
    if ids.numel() < 2:
        raise InputError(f"--data {data} gives {counted(ids.numel(), 'token')}: perplexity needs at least 2")
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


def validate_text_ids(ids: torch.Tensor, vocab: int, name: str, tokenizer: str = "the tokenizer") -> None:
    """The ids of text `name` are rows of the model's embedding: one past it fails deep in a forward as an index
    error (a tokenizer that does not belong to the model)."""
    high = int(ids.max()) if ids.numel() else 0
    if high >= vocab:
        raise InputError(
            f"{tokenizer} gives id {high} on the {name} text, outside its vocabulary of {vocab} tokens (the "
            f"model's config.json vocab_size={vocab}): the tokenizer does not belong to the model"
        )
