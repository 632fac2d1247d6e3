"""Byte counts as people read them (1024-based units), for the terminal, reports, plots and model cards."""

from __future__ import annotations

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
    """A byte count as a size flag takes it (convert.run.parse_size reads it back): in the largest binary
    unit that holds it exactly, 4GiB, 512MiB, else plain bytes."""
    div, unit = 1, ""
    for power, name in enumerate(_UNITS, start=1):
        if n and n % 1024**power == 0:
            div, unit = 1024**power, name
    return f"{n // div}{unit}"
