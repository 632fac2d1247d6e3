"""What the typed option schemas (ConvertOptions, EvalOptions) share: str enums for the strings that choose
a behaviour, and keyword arguments checked against the fields. Torch-free."""

from __future__ import annotations

from dataclasses import fields
from enum import Enum

from mha2gqa.runtime.errors import InputError


class StrEnum(str, Enum):
    """A str whose str() and format() are its value, so "mean" and Method.MEAN compare equal, hash alike
    and serialise to the same JSON (enum.StrEnum is Python 3.11+)."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def parse(cls, value: str, flag: str) -> StrEnum:
        try:
            return cls(value)
        except ValueError:
            raise InputError(f"{flag} {value!r} is unknown (valid: {', '.join(m.value for m in cls)})") from None


def validate_keywords(cls: type, kwargs: dict, function: str) -> None:
    """Refuse a keyword that is not a field of the dataclass `cls` with the TypeError Python gives
    `function(...)` for it, as it did when the fields were that function's own parameters."""
    unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
