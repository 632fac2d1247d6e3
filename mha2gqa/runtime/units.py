"""Byte counts as people read them (1024-based units), for the terminal, reports, plots and model cards."""

from __future__ import annotations

import math
import re

from mha2gqa.runtime.errors import InputError

_UNITS = ("KiB", "MiB", "GiB", "TiB")


def byte_unit(n: float, largest: str = "TiB") -> tuple[int, str]:
    """The power of 1024 and its unit that put |n| in [1, 1024), going no higher than `largest`;
    (1, "B") below 1 KiB."""
    div, unit = 1, "B"
    for power, name in enumerate(_UNITS[: _UNITS.index(largest) + 1], start=1):
        if abs(n) >= 1024**power:
            div, unit = 1024**power, name
    return div, unit


def format_bytes(n: float, digits: int = 2, largest: str = "TiB") -> str:
    """'512 B', '3.00 KiB', '1.25 GiB' (`digits` after the point; whole bytes below 1 KiB)."""
    div, unit = byte_unit(n, largest)
    return f"{n:.0f} B" if div == 1 else f"{n / div:.{digits}f} {unit}"


def format_size(n: int) -> str:
    """A byte count as a size flag takes it (units.parse_size reads it back): in the largest binary
    unit that holds it exactly, 4GiB, 512MiB, else plain bytes."""
    div, unit = 1, ""
    for power, name in enumerate(_UNITS, start=1):
        if n and n % 1024**power == 0:
            div, unit = 1024**power, name
    return f"{n // div}{unit}"


def parse_size(text: str | int, flag: str = "--max-shard-size") -> int:
    """'5GB' (10^9), '500MiB' (2^20) or plain bytes, as transformers reads --max-shard-size.
    `flag` is the option the size came from, for the message."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise InputError(f"{flag} {text!r} is not a size: use e.g. 5GB, 500MB or 2GiB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}.get(unit) or 2 ** (
        10 * "KMGT".index(unit[0]) + 10
    )
    if number * scale < 1:
        raise InputError(f"{flag} {text!r} must be positive")
    if not math.isfinite(number * scale):  # 400 digits read as a float are inf: no size at all
        raise InputError(f"{flag} {text!r} is beyond any size: use e.g. 5GB, 500MB or 2GiB")
    return int(number * scale)


def counted(count: int, noun: str) -> str:
    """'1 step', '2 steps', '1 process', '2 processes', '1 file', '5 files' (never 'file(s)')."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('s') else 's'}"
