"""Text -> token ids: the one place a tokenizer reads text for convert's calibration, uptrain, eval and
convert's check. Two rules for where one document ends and the next begins, each the one its reader's
numbers are defined by:

- document_ids: every document tokenized alone, without special tokens. Calibration takes the ids one
  document after another (first_ids; each document ends in a blank line, textdata.iter_texts's
  end_with_blank_line); uptrain packs them with EOS after each (blocks.pack).
- stream_ids: the documents joined by a blank line (joined) and tokenized once, as one stream, with the
  tokenizer's special tokens (a BOS first): the usual way sliding-window perplexity is reported (e.g.
  wikitext), for eval's text and the check's probe texts.

Importing it imports no torch (stream_ids imports it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

SEPARATOR = "\n\n"  # between the documents of one stream


def validate_ids(highest: int, vocab: int | None, what: str, source) -> None:
    """The one refusal of ids a model cannot embed: `highest`, the largest id SRC's tokenizer gave for `what` (the
    option whose text it is), at or past the model's vocab_size would fail deep in a forward as an index error.
    The plain conversion reads no ids and writes DST; its check records the same fault as a skip (check_run)."""
    from mha2gqa.runtime.errors import InputError

    if vocab is not None and highest >= vocab:
        raise InputError(
            f"{what}: SRC's tokenizer gives id {highest}, outside its vocabulary of {vocab} tokens (config.json "
            f"vocab_size): the tokenizer in {source} does not belong to the model; give SRC its own tokenizer, or "
            "convert without this option"
        )


def document_ids(texts: Iterable[str], tokenizer, batch: int = 64) -> Iterator[list[int]]:
    """The ids of every text, without BOS/EOS, `batch` texts to a tokenizer call (1: no text is read
    before the ids of the one before it are taken)."""
    it = iter(texts)
    while chunk := list(itertools.islice(it, batch)):
        # verbose=False: whole documents exceed model_max_length by design (the ids are cut into blocks)
        yield from tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]


def first_ids(texts: Iterable[str], tokenizer, tokens: int) -> list[int]:
    """The first `tokens` ids of the texts' ids one after another (all of them when they run out first),
    reading no text past the one that reaches `tokens`."""
    ids: list[int] = []
    for doc in document_ids(texts, tokenizer, batch=1):
        ids.extend(doc)
        if len(ids) >= tokens:
            break
    return ids[:tokens]


def joined(docs: Iterable[str]) -> str:
    """The documents that hold some text, a blank line between them: one stream."""
    return SEPARATOR.join(doc for doc in docs if doc.strip())


def stream_ids(text: str, tokenizer, max_tokens: int | None = None):
    """(N,) int64 ids of `text` tokenized as one stream with the tokenizer's special tokens, the first
    `max_tokens` of them when given."""
    import torch

    # verbose=False: the stream is longer than model_max_length on purpose; it is cut into windows.
    ids = tokenizer(text, add_special_tokens=True, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids if max_tokens is None else ids[:max_tokens], dtype=torch.long)
