"""YAML + `key=value` overrides -> a validated Recipe, with every problem reported together."""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from pathlib import Path

import yaml

from mha2gqa.errors import InputError
from mha2gqa.uptrain import recipe_checks
from mha2gqa.uptrain.recipe import Recipe


def load(path, overrides: list[str], check_files: bool = True) -> Recipe:
    raw = _read_yaml(path)
    problems: list[str] = []
    _apply_overrides(raw, overrides, problems)
    recipe = _build(Recipe, raw, "", problems)
    recipe_checks.check(recipe, problems, check_files=check_files)
    if problems:
        raise InputError(f"recipe {path} has {len(problems)} problem(s): " + "; ".join(problems))
    return recipe


def _read_yaml(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"recipe {path}: no such file (see recipes/*.yaml for examples)")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise InputError(f"recipe {path} is not UTF-8 text (byte {err.start}): pass a YAML recipe "
                         "(see recipes/*.yaml)") from err
    except yaml.YAMLError as err:
        raise InputError(f"recipe {path} is not valid YAML: {str(err).splitlines()[0]}") from err
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InputError(f"recipe {path} must be a mapping of key: value, not a {type(raw).__name__}")
    return raw


def _apply_overrides(raw: dict, overrides: list[str], problems: list[str]) -> None:
    """`a.b=v` sets raw['a']['b'] = yaml(v); the schema check later catches unknown keys and bad values."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} is not key=value (e.g. optim.lr=1e-4)")
            continue
        try:
            value = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            value = text
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value


def all_keys(cls=Recipe, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (for suggestions and --help)."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        keys += all_keys(hint, f"{prefix}{f.name}.") if dataclasses.is_dataclass(hint) else [prefix + f.name]
    return keys


def _build(cls, raw: dict, prefix: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            problems.append(_unknown(prefix + str(key)))
    kwargs = {}
    for name in names & set(raw):
        hint, value, dotted = hints[name], raw[name], prefix + name
        if dataclasses.is_dataclass(hint):
            if isinstance(value, dict):
                kwargs[name] = _build(hint, value, dotted + ".", problems)
            elif value is not None:
                problems.append(f"{dotted} is a section: give its keys ({', '.join(all_keys(hint, dotted + '.'))})")
            continue
        try:
            kwargs[name] = _coerce(value, hint)
        except (TypeError, ValueError) as err:
            problems.append(f"{dotted}: {err}")
    return cls(**kwargs)


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown key {key}{hint}"


def _coerce(value, hint):
    """Check `value` against a type hint, converting only lossless forms (1e-4 typed as text, 3.0 -> 3)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        if value is None:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        if value is False and "no" in args:  # YAML 1.1 reads a bare `no` as false
            value = "no"
        if value not in args:
            raise ValueError(f"expected one of {', '.join(args)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"expected a list of {len(args)} numbers like [0.9, 0.95], got {value!r}")
        return tuple(_coerce(v, a) for v, a in zip(value, args))
    if origin is list:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ValueError(f"expected a path/name or a list of them, got {value!r}")
        return list(items)
    return _scalar(value, hint)


def _scalar(value, hint):
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if hint in (int, float) and not isinstance(value, bool):
        if isinstance(value, str):
            try:
                value = float(value.replace("_", ""))
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
        if isinstance(value, (int, float)):
            if not math.isfinite(value):  # .inf passes `> 0` checks and turns every weight into NaN
                raise ValueError(f"expected a finite number, got {value!r}")
            if hint is float:
                return float(value)
            if float(value).is_integer():
                return int(value)
            raise ValueError(f"expected a whole number, got {value!r}")
    if hint is str and isinstance(value, str):
        return value
    raise ValueError(f"expected {'a number' if hint in (int, float) else 'text'}, got {value!r}")
