"""Calibration text, from the spec a user writes to the token ids every reader of it takes: the one reading.

- resolve_calibration: a spec in the mix notation (mix.py: one text, `parent`, or parts with shares) checked and
  resolved once, before anything is read in earnest (every file found and of a known format, holding some
  text; 'austen' expanded to the embedded novels): a CalibrationInput, which convert's plan carries and its
  dry run prints;
- read_calibration: a CalibrationInput -> (ids, record), the one call of convert's stages, the layer losses of
  --kv-budget, sweep's statistics and calibrate(): text tokenized with the source's tokenizer, samples drawn
  from the parent (sampling.py; the parent is loaded only when a part samples it), the parts' whole blocks
  mixed in the SPREAD order (blocks.mix_blocks), and what a record says of them.

How many tokens, in what block length and at what price is the caller's plan (convert/inputs.py, prepare.py);
this module only reads. Importing it imports no torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from mha2gqa.corpus import textdata
from mha2gqa.corpus.mix import PARENT, parse_spec, part_tokens
from mha2gqa.runtime.errors import InputError, InputWarning

PIECE_CHARS = 1 << 16  # characters of a text file tokenized at a time


@dataclass(frozen=True)
class CalibrationPart:
    """One source of calibration tokens: text (a resolved textdata.TextSource) or samples of the parent."""

    name: str  # as the user typed it: a path, 'austen', a hub dataset, 'parent'; several files joined by ', '
    entries: tuple[str, ...]  # what it reads ('austen' expanded to its files); () for the parent
    share: float  # of all the calibration tokens (1.0 for a single source)
    tokens: int  # how many tokens it gives
    text: object = None  # textdata.TextSource, resolved once; None for the parent's samples

    @property
    def sampled(self) -> bool:
        return self.text is None


@dataclass(frozen=True)
class CalibrationInput:
    """The calibration text of one run, checked and resolved once (resolve_calibration)."""

    spec: str | list[str]  # as the command line writes it back (the Reproduce line)
    parts: tuple[CalibrationPart, ...]
    tokens: int  # --calibration-tokens: all parts together
    seq_len: int  # tokens per block

    @property
    def mixed(self) -> bool:
        return len(self.parts) > 1

    @property
    def sampled_tokens(self) -> int:
        return sum(part.tokens for part in self.parts if part.sampled)

    def budgeted(self, tokens: int | None) -> CalibrationInput:
        """These resolved parts for `tokens` in all (None: as they are): what resolve_calibration(self.spec, tokens,
        ...) gives, without resolving the text again (a sweep resolves its calibration once for every plan)."""
        if tokens is None or tokens == self.tokens:
            return self
        pairs = parse_spec(self.spec)
        shares = [share for _, share in pairs] if pairs[0][1] is not None else [1.0]
        counts = part_tokens(shares, tokens, self.seq_len)
        parts = (replace(p, share=s / sum(shares), tokens=n) for p, s, n in zip(self.parts, shares, counts))
        return replace(self, parts=tuple(parts), tokens=tokens)


def resolve_calibration(
    spec, tokens: int | None, seq_len: int, defaults: tuple[int, int] = (0, 0), flag: str = "--calibration"
) -> CalibrationInput:
    """`spec` checked and resolved once: every file found and of a known format, holding some text, before
    anything is read in earnest; 'austen' expanded to the embedded novels. `tokens` None: the caller's
    `defaults`, (of a text, when the parent's samples are part of it) (convert's: inputs.default_tokens)."""
    pairs = parse_spec(spec, flag)
    if tokens is None:
        tokens = defaults[1] if any(name == PARENT for name, _ in pairs) else defaults[0]
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise InputError(f"--calibration-tokens {tokens} must be at least 1 (e.g. 131072)")
    shared = pairs[0][1] is not None
    if not shared and len(pairs) > 1 and any(name == PARENT for name, _ in pairs):
        raise InputError(
            f"{flag} {PARENT} samples the model, and cannot be read in order with other text: give every entry "
            f"a share, e.g. {flag} {PARENT}:0.5 {flag} {next(n for n, _ in pairs if n != PARENT)}:0.5"
        )
    groups = [[name] for name, _ in pairs] if shared or pairs[0][0] == PARENT else [[name for name, _ in pairs]]
    shares = [share for _, share in pairs] if shared else [1.0]
    counts = part_tokens(shares, tokens, seq_len)
    parts = []
    for names, share, count in zip(groups, shares, counts):
        name = ", ".join(names)
        if names == [PARENT]:
            parts.append(CalibrationPart(name, (), share / sum(shares), count))
            continue
        entries = _files(names, flag)
        text = textdata.resolve(flag, list(entries))
        textdata.require_text(text)
        parts.append(CalibrationPart(name, entries, share / sum(shares), count, text))
    written = [f"{n}:{s:g}" for (n, s) in pairs] if shared else [n for n, _ in pairs]
    return CalibrationInput(written[0] if len(written) == 1 else written, tuple(parts), tokens, seq_len)


def text_files(spec, flag: str = "--calibration") -> list[str]:
    """What the text parts of `spec` read, in order ('austen' as the embedded novels' files), resolving nothing:
    what a sweep suggests uptraining on. The parent's samples are no text."""
    return list(_files([name for name, _ in parse_spec(spec, flag) if name != PARENT], flag))


def _files(names: list[str], flag: str) -> tuple[str, ...]:
    from mha2gqa.files.embedded import expand_corpus_name

    expanded = (expand_corpus_name(name, flag) for name in names)
    return tuple(str(p) for found in expanded for p in (found if isinstance(found, (list, tuple)) else [found]))


def read_calibration(
    calibration: CalibrationInput,
    source: Path,
    seed: int = 0,
    load_parent: Callable[[], object] | None = None,
    tokenizer=None,
    progress: bool = True,
):
    """The calibration ids (N,) of every part of `calibration` and what to record of them: text tokenized with
    `tokenizer` (None: the source's own), samples drawn from the parent, which `load_parent` gives (called only
    when a part samples it: a calibration of text alone never loads a model here); one part's ids as they are,
    several parts' whole blocks in the SPREAD order. `seed` seeds the parent's samples."""
    from mha2gqa.architecture.layouts import read_config
    from mha2gqa.corpus import sampling
    from mha2gqa.corpus.blocks import MixOrder, full_blocks, mix_blocks

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
    config, seq_len = read_config(source), calibration.seq_len
    per_part = _texts(calibration, tokenizer, config, source)  # first: ids the model cannot embed refuse sampling
    parent = _parent(load_parent) if any(part.sampled for part in calibration.parts) else None
    batch = sampling.batch_for(config, seq_len)
    for index, part in enumerate(calibration.parts):
        if part.sampled:
            drawn = sampling.sample_ids(parent, tokenizer, part.tokens, seq_len, seed, progress=progress, batch=batch)
            per_part[index] = drawn
    per_part = [per_part[index] for index in range(len(calibration.parts))]
    if len(per_part) == 1:
        ids = per_part[0]
    else:
        ids = mix_blocks([full_blocks(p, seq_len) for p in per_part], MixOrder.SPREAD).reshape(-1)
    parts = [_part_record(part, len(found)) for part, found in zip(calibration.parts, per_part)]
    record = {"data": calibration.spec, "tokens_requested": calibration.tokens, "parts": parts}
    if parent is not None:
        record["sampling"] = sampling.sampling_record(parent, tokenizer, seq_len, seed, batch=batch)
    return ids, record


def _texts(calibration: CalibrationInput, tokenizer, config: dict, source: Path) -> dict:
    """{part index: ids} of every text part, each checked against the model's vocabulary."""
    from mha2gqa.architecture.layouts import config_vocab
    from mha2gqa.corpus.tokens import validate_ids

    found = {}
    for index, part in enumerate(calibration.parts):
        if not part.sampled:
            texts = textdata.iter_texts(part.text, piece_chars=PIECE_CHARS, end_with_blank_line=True)
            found[index] = text_ids(tokenizer, texts, part.tokens, part.name)
            validate_ids(int(found[index].max()), config_vocab(config) or None, f"--calibration {part.name}", source)
    return found


def _part_record(part: CalibrationPart, tokens: int) -> dict:
    row = {"name": part.name, "share": part.share, "tokens": tokens, "asked": part.tokens}
    if not part.sampled:  # the files read ('austen' is the embedded novels), for the record
        row["files"] = list(part.entries)
    return row


def _parent(load_parent):
    if load_parent is None:  # a caller's bug: whoever asks for the parent's samples must say where the parent is
        raise ValueError("--calibration parent samples the parent: read_calibration needs load_parent")
    return load_parent()


def text_ids(tokenizer, texts: Iterator[str], tokens: int, name: str = ""):
    """The first `tokens` ids of the concatenated texts, (N,) int64; fewer, with one warning line naming
    both counts, when the text runs out first."""
    import torch

    from mha2gqa.corpus.tokens import first_ids

    ids = first_ids(texts, tokenizer, tokens)
    if not ids:
        raise InputError(f"--calibration {name}: the calibration data holds no text")
    if len(ids) < tokens:
        warnings.warn(
            f"--calibration {name} holds {len(ids):,} tokens, fewer than the {tokens:,} asked for: all of them are "
            "used (give more text, or lower --calibration-tokens)",
            InputWarning,
            stacklevel=2,
        )
    return torch.tensor(ids, dtype=torch.long)
