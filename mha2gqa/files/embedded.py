"""The embedded default: six Jane Austen novels and a small MHA model trained on five of them.

Everything here ships inside the package (no download). The novels are stored gzip-compressed;
`write_corpus` decompresses them to plain `.txt` files for `datasets.load_dataset("text", ...)`.
Persuasion is held out: the tokenizer and the model never saw it, so it measures perplexity.
"""

from __future__ import annotations

import difflib
import gzip
import os
from pathlib import Path

from mha2gqa.files.writing import write_atomic
from mha2gqa.records import provenance
from mha2gqa.runtime.errors import InputError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CORPUS_DIR = DATA_DIR / "austen"
MODEL_DIR = DATA_DIR / "austen-mha"

# Alphabetical, so every consumer sees the novels in the same order (the tokenizer depends on it).
TRAIN_NOVELS = ("emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility")
HELDOUT_NOVEL = "persuasion"
NOVELS = tuple(sorted(TRAIN_NOVELS + (HELDOUT_NOVEL,)))
SPLITS = {"train": TRAIN_NOVELS, "heldout": (HELDOUT_NOVEL,), "all": NOVELS}
CORPUS_NAME = "austen"  # what a user types for the five training novels (e.g. --calibration austen)


def novel_path(name: str) -> Path:
    """The compressed file of one novel, e.g. `novel_path("persuasion")`."""
    if name not in NOVELS:
        raise InputError(f"unknown novel {name!r}: choose one of {', '.join(NOVELS)}")
    return CORPUS_DIR / f"{name}.txt.gz"


def train_paths() -> list[Path]:
    """The five training novels (compressed), in a fixed order."""
    return [novel_path(name) for name in TRAIN_NOVELS]


def heldout_path() -> Path:
    """Persuasion (compressed): never seen in training; used for validation and perplexity."""
    return novel_path(HELDOUT_NOVEL)


def expand_corpus_name(spec, flag: str = "--calibration"):
    """The five training novels' paths for CORPUS_NAME; anything else unchanged. Commands call this on
    the text a user names, so the readers (mha2gqa.corpus.textdata) only ever see files. A name that is no
    local path and is one typo away from CORPUS_NAME (austin, austen.) is refused here, with the fix,
    rather than looked up on the hub as a dataset."""
    if spec == CORPUS_NAME:
        return [str(p) for p in train_paths()]
    if isinstance(spec, str) and not Path(spec).expanduser().exists() and _near(spec, CORPUS_NAME):
        raise InputError(f"{flag} {spec}: no such file or folder; did you mean {CORPUS_NAME} (the embedded novels)?")
    return spec


def _near(name: str, known: str) -> bool:
    """One edit or a swap away (case ignored), the typos worth a "did you mean"."""
    return name != known and difflib.SequenceMatcher(None, name.lower(), known).ratio() >= 0.8


def target_groups() -> list[int]:
    """The kv-head counts the embedded model converts to (what `demo --groups` accepts), by the rule
    `convert` checks (layouts.target_groups)."""
    from mha2gqa.architecture.layouts import attention_shape, read_config
    from mha2gqa.architecture.layouts import target_groups as valid_targets

    return valid_targets(attention_shape(read_config(MODEL_DIR)))


def read_novel(name: str) -> str:
    """One novel's full text."""
    return gzip.decompress(novel_path(name).read_bytes()).decode("utf-8")


def write_corpus(out_dir: str | os.PathLike, split: str = "train") -> list[Path]:
    """Decompress the novels of `split` ("train", "heldout" or "all") into `out_dir` as `<name>.txt`.

    Returns the written paths, ready for `load_dataset("text", data_files=[str(p) for p in paths])`.
    An existing file with the same bytes is left as it is, so repeated calls are cheap.
    """
    if split not in SPLITS:
        raise InputError(f"split {split!r} is not known: choose one of {', '.join(SPLITS)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file: pass a directory to write the corpus into")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in SPLITS[split]:
        data = gzip.decompress(novel_path(name).read_bytes())
        path = out / f"{name}.txt"
        if not (path.is_file() and path.read_bytes() == data):
            write_atomic(path, data)  # a reader never sees half a novel
        paths.append(path)
    return paths


def tokenizer_dir() -> Path:
    """The HF tokenizer (byte-level BPE trained on the five training novels); it lives beside the
    model's weights so that `AutoTokenizer.from_pretrained(model_dir())` works too."""
    return MODEL_DIR


def model_dir() -> Path:
    """The embedded pretrained MHA Llama model (safetensors, config, tokenizer, metrics, provenance)."""
    return MODEL_DIR


def pretrain_tokens() -> int:
    """Training tokens the embedded model was pretrained on, from its provenance (mha2gqa.json,
    written by the uptrain loop): the base of the demo's alpha (uptrain for alpha x this many)."""
    return int(provenance.latest(MODEL_DIR, "uptrain")["tokens_seen"])
