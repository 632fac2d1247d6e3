"""Every recipe key with its default and docstring, read from the schema's source (the docstrings
under each field are the documentation: one place to keep it)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

from mha2gqa.uptrain import recipe as schema


def _field_docs(cls) -> dict[str, str]:
    """{field: docstring} of one dataclass: the string literal right after each annotated field."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def describe(cls=schema.Recipe, prefix: str = "") -> list[tuple[str, str, str]]:
    """[(dotted key, default, doc)] for every key of the schema, sections expanded."""
    rows, docs, hints = [], _field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        rows.append((prefix + f.name, "null" if default is None else str(default), docs.get(f.name, "")))
    return rows
