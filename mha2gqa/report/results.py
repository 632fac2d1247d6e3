"""The results a report reads from one file: an eval result (eval/schema.py), or every result a sweep.json holds
(the parent's and each finished candidate's; sweep/schema.py)."""

from __future__ import annotations

import os
from pathlib import Path

from mha2gqa.eval import schema
from mha2gqa.runtime.errors import InputError
from mha2gqa.sweep.schema import SWEEP_SCHEMA


def load_results(path: str | os.PathLike) -> list[dict]:
    """The results in one file: an eval result, or a sweep.json's parent and finished candidates."""
    found = schema.read_result_file(Path(path))
    if isinstance(found, dict) and found.get("schema") == SWEEP_SCHEMA:
        return [_sweep_part(path, name, part) for name, part in _sweep_parts(found)]
    return [schema.validated(found, path)]


def _sweep_parts(record: dict) -> list[tuple[str, object]]:
    candidates = record.get("candidates")
    candidates = candidates if isinstance(candidates, list) else [candidates]
    named = [(c.get("name") if isinstance(c, dict) else None, c) for c in candidates]
    return [("the parent", record.get("parent"))] + [
        (f"candidate {name!r}" if isinstance(name, str) else f"candidate #{i + 1}", c)
        for i, (name, c) in enumerate(named)
    ]


def _sweep_part(path, name: str, part) -> dict:
    """One result inside a sweep.json, refused in the words of that sweep's entry."""
    result = part.get("result") if isinstance(part, dict) else None
    if not isinstance(result, dict):
        found = (
            "no entry" if part is None else f"a JSON {type(part).__name__}" if not isinstance(part, dict) else "none"
        )
        raise InputError(
            f"{path}: {name} of the sweep has no eval result ({found}): pass a sweep.json written by "
            "`mha2gqa sweep`, unedited, or re-run the sweep"
        )
    return schema.validated(result, f"{path} ({name} of the sweep)")
