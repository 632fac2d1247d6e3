"""What data.train and data.eval name, resolved without torch (recipe_load checks it, data.py and
mixed_data.py read it).

The names are convert's --calibration names, through the same resolvers: files, folders and a hub dataset
(mha2gqa.corpus.textdata), `austen` (the embedded novels, mha2gqa.files.embedded), and, in data.train only, `parent`:
sequences sampled from distill.teacher (corpus/sampling.py), the data a user always has, and `retrieval`:
prompts that ask for a copy of a fact far back in them, built from the mix's other parts (copy_task.py).
A mix is written
as convert writes one (corpus/mix.parse_spec): every entry with a share, `[parent:0.5, corpus.txt:0.5]`;
each part then gives its share of the blocks the run trains on. A list without shares is one text, its
files read together (the plain path, data.build_data).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.corpus import textdata
from mha2gqa.corpus.mix import PARENT, parse_spec
from mha2gqa.corpus.reserved import warn_if_shadowing
from mha2gqa.files.embedded import expand_corpus_name
from mha2gqa.runtime.errors import InputError

RETRIEVAL = "retrieval"  # the copy-task prompts of copy_task.py, made of the mix's other parts


@dataclass(frozen=True)
class DataPart:
    """One source of training (or eval) blocks."""

    name: str  # as the user typed it ('parent', 'austen', a path); several files of one text joined by ', '
    share: float | None  # of the blocks trained on, normalised; None for the one text of a list without shares
    text: textdata.TextSource | None  # None: sampled from distill.teacher, or made by copy_task.py

    @property
    def sampled(self) -> bool:
        return self.text is None and self.name == PARENT

    @property
    def copies(self) -> bool:
        """The retrieval prompts of copy_task.py, built from the other parts."""
        return self.name == RETRIEVAL


def is_plain(parts: tuple[DataPart, ...]) -> bool:
    """One text without a share: read, packed and shuffled whole (data.build_data), as before mixes."""
    return len(parts) == 1 and parts[0].share is None and not parts[0].sampled


def data_parts(
    key: str, entries, problems: list[str], validate_files: bool = True, field: str = "text"
) -> tuple[DataPart, ...] | None:
    """The parts `entries` name, each problem appended to `problems` (None when the spec itself is bad).
    With the files checked, a text part that holds no text (in `field` of jsonl/json/parquet) is refused
    here, with the other data rules and before torch, not after the model has loaded."""
    try:
        pairs = parse_spec(entries, key)
    except InputError as err:
        problems.append(str(err))
        return None
    names = [name for name, _ in pairs]
    if RETRIEVAL in names:  # reserved in data.train only (in a calibration mix it is a file's name)
        warn_if_shadowing(RETRIEVAL, key, "the copy-task prompts made of the other parts")
    for name in names:
        if _near_parent(name):
            problems.append(
                f"{key} {name}: no such file or folder; did you mean {PARENT} (samples of distill.teacher)?"
            )
            return None
    if pairs[0][1] is None and PARENT in names and len(names) > 1:
        other = next(name for name in names if name != PARENT)
        problems.append(
            f"{key} {PARENT} samples the teacher and cannot be read in order with other text: give every entry "
            f"a share, e.g. {key}=[{PARENT}:0.5,{other}:0.5]"
        )
        return None
    problem = _retrieval_problem(key, pairs)
    if problem:
        problems.append(problem)
        return None
    if pairs[0][1] is None and names != [PARENT]:
        groups, shares = [names], [None]  # one text, its files read together
    else:
        total = sum(share or 1.0 for _, share in pairs)
        groups, shares = [[name] for name in names], [(share or 1.0) / total for _, share in pairs]
    parts = []
    for group, share in zip(groups, shares):
        if group in ([PARENT], [RETRIEVAL]):
            parts.append(DataPart(group[0], share, None))
            continue
        text = _text(key, group, problems, validate_files, field)
        if text is None:
            return None
        parts.append(DataPart(", ".join(group), share, text))
    return tuple(parts)


def _text(
    key: str, names: list[str], problems: list[str], validate_files: bool, field: str
) -> textdata.TextSource | None:
    """The text `names` name, 'austen' expanded to the embedded novels (as convert does), holding some text."""
    entries = []
    try:
        for name in names:
            expanded = expand_corpus_name(name, key)
            entries += expanded if isinstance(expanded, list) else [expanded]
    except InputError as err:
        problems.append(str(err))
        return None
    before = len(problems)
    source = textdata.resolve(key, entries, problems, validate_files, one_format=True)
    if source is not None and validate_files and len(problems) == before:
        try:  # reads no further than the first piece with text in it
            textdata.require_text(source, field, "data.text_field")
        except InputError as err:
            problems.append(str(err))
    return source if len(problems) == before else None


def _retrieval_problem(key: str, pairs: list) -> str | None:
    """`retrieval` is a share of data.train beside a part it is made of (its haystack, keys and values)."""
    names = [name for name, _ in pairs]
    if RETRIEVAL not in names or Path(RETRIEVAL).exists():
        return None
    if key != "data.train":
        return f"{key} {RETRIEVAL}: the copy-task prompts are training data: name them in data.train only"
    if pairs[0][1] is None or len(names) == 1:
        other = next((name for name in names if name != RETRIEVAL), PARENT)
        return (
            f"{key} {RETRIEVAL} is made of the other parts of a mix: give every entry a share, e.g. "
            f"{key}=[{other}:0.75,{RETRIEVAL}:0.25]"
        )
    return None


def _near_parent(name: str) -> bool:
    """A typo of `parent` (parnet, Parent) that is no local path: refused with the fix, not looked up on
    the hub as a dataset of that name."""
    if name == PARENT or "/" in name or Path(name).expanduser().exists():
        return False
    return difflib.SequenceMatcher(None, name.lower(), PARENT).ratio() >= 0.8


def validate_rules(recipe, parts: dict, problems: list[str]) -> None:
    """What a sampled or mixed data.train needs from the rest of the recipe; data.eval is text only."""
    train, evals, cfg = parts.get("data.train"), parts.get("data.eval"), recipe.data
    if train and any(part.sampled for part in train):
        if not recipe.distill.teacher:
            problems.append(
                f"data.train {PARENT} samples the teacher, and distill.teacher is unset: set "
                "distill.teacher=<the MHA parent's dir or hub id> (the model the conversion started from)"
            )
        if cfg.streaming:
            problems.append(f"data.train {PARENT} is drawn in memory and cannot be streamed: set data.streaming=false")
    elif train and not is_plain(train) and cfg.streaming:
        problems.append("data.train with shares is mixed in memory and cannot be streamed: set data.streaming=false")
    if evals and not is_plain(evals):
        problems.append(
            f"data.eval {', '.join(cfg.eval)}: eval data is one text without shares; leave data.eval unset "
            "to hold out blocks of data.train (for parent: samples drawn with a seed of their own)"
        )
