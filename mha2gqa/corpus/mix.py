"""The notation that names several texts, on the command line and in Python alike: convert's --calibration
and uptrain's data.train write a mix the same way.

- `corpus.txt` (repeat it for several files, read in order), a folder, a hub dataset, or `austen` (the
  embedded novels): one text;
- `parent`: text sampled from the model being converted, or uptrain's teacher (no data of the user's at
  all; sampling.py);
- a mix: every entry with a share after a colon, `parent:0.5 austen:0.5` (percentages too, `parent:50%`);
  the shares are normalised, and each part gives that share of the tokens in whole blocks, the parts' blocks
  interleaved so that every stretch of the text (and refine's held-out blocks) holds each part in
  proportion. In Python a dict says the same: {"parent": 0.5, "austen": 0.5}.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from mha2gqa.errors import InputError

PARENT = "parent"  # the source sampled from the model itself (sampling.py)
_SHARE = re.compile(r"^(?P<name>.+):(?P<share>\d+(?:\.\d*)?|\.\d+)(?P<percent>%?)$")


def parse_spec(spec, flag: str = "--calibration") -> list[tuple[str, float | None]]:
    """[(entry, share or None)] of a mix (--calibration, data.train): a str, a list of str, or a {entry: share}
    dict. Shares
    are all given or all absent; each is a positive number or percentage."""
    if isinstance(spec, dict):
        pairs = [(str(name), share) for name, share in spec.items()]
        for name, share in pairs:
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share):
                raise InputError(f"{flag} {name}: share {share!r} must be a positive number, e.g. 0.5")
    else:
        pairs = [_split_share(str(entry)) for entry in ([spec] if isinstance(spec, (str, Path)) else spec)]
    if not pairs:
        raise InputError(f"{flag} is empty: give a file, a folder, 'austen', 'parent' or a hub dataset name")
    shared = [share is not None for _, share in pairs]
    if any(shared) and not all(shared):
        missing = next(name for name, share in pairs if share is None)
        raise InputError(
            f"{flag} {missing} has no share while others do: give every entry one, e.g. {flag} {missing}:0.5"
        )
    for name, share in pairs:
        if share is not None and not share > 0:
            raise InputError(f"{flag} {name}:{share:g}: a share must be above 0 (e.g. {name}:0.5)")
    names = [name for name, _ in pairs]
    if any(shared) and len(set(names)) < len(names):
        repeated = next(name for name in names if names.count(name) > 1)
        raise InputError(f"{flag} {repeated} is given twice in a mix: give it once, with the sum of its shares")
    return pairs


def _split_share(entry: str) -> tuple[str, float | None]:
    """'corpus.txt:0.5' -> ('corpus.txt', 0.5); '50%' is 0.5. A whole entry that is a local path (even one
    with a colon in its name) is a path."""
    match = _SHARE.match(entry)
    if match is None or Path(entry).expanduser().exists():
        return entry, None
    share = float(match.group("share")) / (100 if match.group("percent") else 1)
    return match.group("name"), share


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


def interleaved(counts: list[int]) -> list[tuple[int, int]]:
    """(part, block) for every block of parts holding `counts` blocks, in the one order that spreads each
    part evenly: block i of a part of n blocks goes at (i + 0.5) / n, ties in part order. So any stretch
    of the result, and so refine's subset and its held-out tail, holds every part in proportion (the parts
    of a mix, and the two kinds of the parent's samples)."""
    keyed = sorted(((i + 0.5) / n, p, i) for p, n in enumerate(counts) for i in range(n))
    return [(p, i) for _, p, i in keyed]
