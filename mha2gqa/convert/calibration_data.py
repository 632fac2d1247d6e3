"""Calibration text -> token ids: local text files, a folder of them, the embedded Austen novels, or a
hub dataset (online only). Text is read and tokenized in pieces, so a huge file costs little memory."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator

import torch

from mha2gqa.errors import InputError
from mha2gqa.sources import hub_offline

EMBEDDED = "austen"  # the five training novels shipped in mha2gqa/data
TEXT_SUFFIXES = (".txt", ".txt.gz", ".md", ".jsonl")
_PIECE_CHARS = 1 << 16  # characters tokenized at a time


def iter_texts(spec: str) -> Iterator[str]:
    """Pieces of text from `spec`: 'austen', a text file (.txt, .txt.gz, .md, or .jsonl with a "text"
    field), a directory of such files (sorted), or a hub dataset id with a "text" column."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES))
        if not files:
            raise InputError(f"--calibration {spec}: the directory has no {', '.join(TEXT_SUFFIXES)} files")
        for file in files:
            yield from _file_texts(file)
    elif path.is_file():
        if not path.name.endswith(TEXT_SUFFIXES):
            raise InputError(f"--calibration {spec}: not a text file (use {', '.join(TEXT_SUFFIXES)})")
        yield from _file_texts(path)
    elif spec == EMBEDDED:
        from mha2gqa import embedded

        for name in embedded.TRAIN_NOVELS:
            yield embedded.read_novel(name) + "\n\n"
    else:
        yield from _hub_texts(spec)


def _file_texts(path: Path) -> Iterator[str]:
    if path.name.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    record = json.loads(line)
                    if "text" not in record:
                        raise InputError(f"{path}:{number} has no \"text\" field: calibration jsonl needs one per line")
                    yield record["text"] + "\n\n"
        return
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        piece: list[str] = []
        size = 0
        for line in f:  # pieces end at line ends, so no word is cut in two
            piece.append(line)
            size += len(line)
            if size >= _PIECE_CHARS:
                yield "".join(piece)
                piece, size = [], 0
        if piece:
            yield "".join(piece) + "\n"


def _hub_texts(spec: str) -> Iterator[str]:
    if hub_offline():
        raise InputError(f"--calibration {spec}: no such file or directory, and the hub is offline "
                         "(HF_HUB_OFFLINE=1); pass a local text file, a directory, or 'austen'")
    from datasets import load_dataset

    try:
        rows = load_dataset(spec, split="train", streaming=True)
    except Exception as err:  # missing dataset, network, auth: all the user's to fix
        raise InputError(f"--calibration {spec}: could not open it as a hub dataset ({type(err).__name__}); "
                         "pass a local text file or directory") from err
    for row in rows:
        if "text" not in row:
            raise InputError(f"--calibration {spec}: the dataset has no 'text' column (columns: {', '.join(row)})")
        yield row["text"] + "\n\n"


def calibration_ids(tokenizer, texts: Iterator[str], tokens: int) -> torch.Tensor:
    """The first `tokens` ids of the concatenated texts, (N,) int64."""
    if tokens < 1:
        raise InputError(f"--calibration-tokens {tokens} must be at least 1 (e.g. 131072)")
    ids: list[int] = []
    for text in texts:
        # verbose=False: no "longer than the model's maximum" warning, the ids are cut into blocks later
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if len(ids) >= tokens:
            break
    if not ids:
        raise InputError("--calibration: the calibration data holds no text")
    return torch.tensor(ids[:tokens], dtype=torch.long)
