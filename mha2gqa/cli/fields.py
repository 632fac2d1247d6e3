"""Click options made from the fields of a typed schema (ConvertOptions, RefineOptions, EvalOptions,
SweepOptions): the default is the field's and the help its docstring, so neither is written twice
(tests/test_docfields.py holds every command to it)."""

from __future__ import annotations

import dataclasses
from enum import Enum

import click

from mha2gqa.runtime.docfields import option_help


def field_default(cls: type, name: str):
    """The default of dataclass field `name` (dataclasses.MISSING when it has none)."""
    found = next(f for f in dataclasses.fields(cls) if f.name == name)
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    return found.default


def cli_text(value):
    """A field's default as the command line writes it: an enum's value, a tuple comma-separated."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return value


def field_option(cls: type, flag: str, *decls: str, field: str | None = None, choices=None, as_text=None, **kwargs):
    """click.option(flag, *decls) for the field `field` of `cls` (default: the parameter name among `decls`,
    else the flag's, --max-shard-size -> max_shard_size), with the field's default (through `as_text`, e.g. a byte count written as 4GiB,
    when the flag takes text) and its docstring as help (then `value: doc` for each of `choices`)."""
    named = [d for d in decls if not d.startswith("-")]
    field = field or (named[0] if named else flag.lstrip("-").replace("-", "_"))
    default = field_default(cls, field)
    if default is not dataclasses.MISSING and "default" not in kwargs:
        kwargs["default"] = as_text(default) if as_text else cli_text(default)
        kwargs.setdefault("show_default", kwargs["default"] is not None and not kwargs.get("is_flag"))
    return click.option(flag, *decls, help=option_help(cls, field, choices), **kwargs)


class TokenCount(click.ParamType):
    """A whole number of tokens, or all (None: every token)."""

    name = "INTEGER|all"

    def convert(self, value, param, ctx):
        if value is None or value == "all" or isinstance(value, int):
            return None if value == "all" else value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number of tokens nor all", param, ctx)
