"""The docstring under each field of a typed schema (ConvertOptions, EvalOptions, the uptrain Recipe, an
enum's members), read from the source: those docstrings are the documentation, so `--help` and the
recipe key list are built from them rather than repeating them. Torch-free: the CLI builds its help
from this at start-up (one parse of each schema module, about a millisecond)."""

from __future__ import annotations

import ast
import sys
from enum import Enum
from functools import cache


@cache
def _classes(path: str) -> dict[str, ast.ClassDef]:
    """{qualified name: class node} of every class in one source file, nested classes included."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found, todo = {}, [("", node) for node in tree.body]
    while todo:
        prefix, node = todo.pop()
        if isinstance(node, ast.ClassDef):
            found[prefix + node.name] = node
            todo += [(f"{prefix}{node.name}.", child) for child in node.body]
    return found


@cache  # the CLI asks once per option of a class: 86 times at start-up
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring, whitespace-normalised} of one class: the string literal right after each
    annotated field (`name: type = ...`) or enum member (`NAME = value`), in source order."""
    body = _classes(sys.modules[cls.__module__].__file__)[cls.__qualname__].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if not (
            isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
        ):
            continue
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            docs[node.target.id] = " ".join(after.value.value.split())
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            docs[node.targets[0].id] = " ".join(after.value.value.split())
    return docs


def choice_docs(enum: type[Enum]) -> dict[str, str]:
    """{value: docstring} of an enum's documented members."""
    return {enum[name].value: doc for name, doc in field_docs(enum).items()}


def option_help(cls: type, field: str, choices: dict[str, str] | None = None) -> str:
    """The --help of the option that sets `cls.field`: the field's docstring, then `value: doc` for
    each choice when the option picks one of several."""
    text = field_docs(cls)[field]
    if choices:
        text += " " + "; ".join(f"{value}: {doc.rstrip('.')}" for value, doc in choices.items()) + "."
    return text
