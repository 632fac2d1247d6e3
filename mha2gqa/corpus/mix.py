"""The notation that names several texts, on the command line and in Python alike: convert's --calibration
and uptrain's data.train write a mix the same way.

- `corpus.txt` (repeat it for several files, read in order), a folder, a hub dataset, or `austen` (the
  embedded novels): one text;
- `parent`: text sampled from the model being converted, or uptrain's teacher (no data of the user's at
  all; sampling.py);
- a mix: every entry with a share after a colon, `parent:0.5 austen:0.5` (percentages too, `parent:50%`);
  the shares are normalised, and each part gives that share of the tokens in whole blocks (part_tokens), the
  parts' blocks mixed by blocks.mix_blocks. In Python a dict says the same: {"parent": 0.5, "austen": 0.5}.

One reader of shares serves every place that takes a mix (convert --calibration and --config, uptrain's
data.train, sweep --calibration): read_share, which refuses anything but a positive finite number or
percentage with the rule (SHARE_RULE) rather than reading it as part of a file name.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from mha2gqa.corpus.reserved import warn_if_shadowing
from mha2gqa.files.embedded import CORPUS_NAME
from mha2gqa.runtime.errors import InputError

PARENT = "parent"  # the source sampled from the model itself (sampling.py)
RESERVED = {PARENT: "text sampled from the model", CORPUS_NAME: "the embedded Austen novels"}
SHARE_RULE = "a share is a positive number or percentage, e.g. 0.5 or 50%"
COLON_PATHS = "a path whose name holds a colon is read whole when it exists (in a mix, add its share: a:b.txt:0.5)"
_NUMBER = re.compile(r"\+?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")  # what float() reads, minus nan/inf/_
_SHARE_LIKE = re.compile(r"[\s\d+\-.,%eE]*|[+-]?(?:nan|inf|infinity)%?", re.IGNORECASE)  # meant as a share


def parse_spec(spec, flag: str = "--calibration") -> list[tuple[str, float | None]]:
    """[(entry, share or None)] of a mix (--calibration, data.train, a config's calibration): a str, a list of
    str, or a {entry: share} dict. Shares are all given or all absent; each is read by read_share."""
    if isinstance(spec, dict):
        pairs = [(str(name), read_share(share, str(name), flag)) for name, share in spec.items()]
    else:
        pairs = [_split_share(entry, flag) for entry in _entries(spec, flag)]
    if not pairs:
        raise InputError(f"{flag} is empty: give a file, a folder, 'austen', 'parent' or a hub dataset name")
    shared = [share is not None for _, share in pairs]
    if any(shared) and not all(shared):
        missing = next(name for name, share in pairs if share is None)
        if ":" in missing:  # what follows its last colon was read as part of the name: it is a bad share
            head, _, tail = missing.rpartition(":")
            read_share(tail, head, flag)
        raise InputError(
            f"{flag} {missing} has no share while others do: give every entry one, e.g. {flag} {missing}:0.5"
        )
    names = [name for name, _ in pairs]
    for name in dict.fromkeys(name for name in names if name in RESERVED):  # in the order given, once each
        warn_if_shadowing(name, flag, RESERVED[name])
    if any(shared) and len(set(names)) < len(names):
        repeated = next(name for name in names if names.count(name) > 1)
        raise InputError(f"{flag} {repeated} is given twice in a mix: give it once, with the sum of its shares")
    return pairs


def _entries(spec, flag: str) -> list[str]:
    """The entries of a str or list spec. An entry with commas that is no existing path is several entries, as
    if the flag were repeated: `parent:0.75,austen:0.25` is `parent:0.75 austen:0.25`. A piece that is a bare
    number (`parent:0,75`, a decimal comma) or empty is refused: it names no text."""
    found = []
    for entry in [spec] if isinstance(spec, (str, Path)) else spec:
        text = str(entry)
        if "," not in text or Path(text).expanduser().exists():
            found.append(text)
            continue
        pieces = [piece.strip() for piece in text.split(",")]
        for piece in pieces:
            if not piece or _SHARE_LIKE.fullmatch(piece):
                raise InputError(
                    f"{flag} {text}: a comma separates texts, as repeating {flag} does, and {piece!r} names no text: "
                    f"give each text its share with a dot, e.g. {flag} parent:0.75,austen:0.25"
                )
        found += pieces
    return found


def renamed(spec, rename, flag: str) -> list[str]:
    """`spec` in the notation's words (`name`, or `name:share`) with every name passed through `rename`."""
    return [rename(name) if share is None else f"{rename(name)}:{share:g}" for name, share in parse_spec(spec, flag)]


def as_words(value, flag: str):
    """A mix as YAML holds it, in the notation's words (`name:share`): a {name: share} mapping, or a list of
    strings and one-entry mappings (YAML reads `[a.txt: 0.5]` and `[a.txt:, b.txt:0.5]` so), each share read
    now by read_share. Any other value passes unchanged, for the caller's own type check to name."""
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not any(isinstance(item, dict) for item in items):
        return value
    words = []
    for item in items:
        if isinstance(item, dict):
            words += [f"{name}:{read_share(share, str(name), flag)!r}" for name, share in item.items()]
        else:
            words.append(item)
    return words


def read_share(value, name: str, flag: str) -> float:
    """The one reader of a share, typed (`parent:50%`) or given as a number ({parent: 0.5}): a positive finite
    number, or a percentage of one; anything else (negative, 0, empty, nan, inf, a word, a value that
    rounds to 0) is refused with the rule."""
    share = _number(value)
    if share is None or not math.isfinite(share) or not share > 0:
        shown = "" if value is None else str(value).strip()  # YAML's `a.txt:` holds None
        what = "the share after the colon is empty" if not shown else f"{shown!r} is not a share"
        raise InputError(f"{flag} {name}:{shown}: {what}: {SHARE_RULE}; {COLON_PATHS}")
    return share


def _number(value) -> float | None:
    """A share's value as a float (a percentage divided by 100), or None when it is no number at all."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    if not isinstance(value, str):
        return float(value) if abs(value) < 1e308 else math.inf  # an int past float's range is not finite
    text = value.strip()
    number, percent = (text[:-1], True) if text.endswith("%") else (text, False)
    if not _NUMBER.fullmatch(number):
        return None
    return float(number) / (100 if percent else 1)


def _split_share(entry: str, flag: str) -> tuple[str, float | None]:
    """'corpus.txt:0.5' -> ('corpus.txt', 0.5); '50%' is 0.5. An entry that is a local path (even one with
    a colon in its name) is a path. Otherwise what follows the last colon is a share when it looks meant as
    one (digits, sign, dot, %, e, nan/inf, or nothing) or when what precedes it is a text that exists (a
    file, a folder, 'parent', 'austen'); it is then read by read_share, and refused with the rule if bad."""
    if ":" not in entry or Path(entry).expanduser().exists():
        return entry, None
    name, _, tail = entry.rpartition(":")
    if not (_SHARE_LIKE.fullmatch(tail) or name in (PARENT, CORPUS_NAME) or Path(name).expanduser().exists()):
        return entry, None  # a name with a colon in it (a hub dataset's, say): the readers judge it
    if not name:
        raise InputError(f"{flag} {entry}: names no text before its share: give a file, e.g. corpus.txt{entry}")
    return name, read_share(tail, name, flag)


def part_tokens(shares: list[float], tokens: int, seq_len: int) -> list[int]:
    """Each part's tokens: its share of `tokens` in whole blocks (at least one), the rounding left to the
    largest part so that the total is what was asked for, to a block."""
    if len(shares) == 1:
        return [tokens]
    total = sum(shares)
    blocks = max(len(shares), round(tokens / seq_len))
    counts = [max(1, round(blocks * share / total)) for share in shares]
    counts[counts.index(max(counts))] += blocks - sum(counts)
    return [count * seq_len for count in counts]
