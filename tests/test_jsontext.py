"""Nothing mha2gqa writes is invalid JSON (issue 38): one writer, jsontext.dumps (allow_nan=False, a
non-finite number as null), and no module of the package that calls json.dump or json.dumps itself."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
from tiny_models import save_tiny_model

from mha2gqa import convert
from mha2gqa.eval.schema import write_result
from mha2gqa.files import jsontext
from mha2gqa.records.provenance import FILE_NAME, append

PACKAGE = Path(__file__).resolve().parent.parent / "mha2gqa"
WRITER = PACKAGE / "files" / "jsontext.py"


def json_writes(source: str) -> list[int]:
    """Line numbers of every json.dump/json.dumps call (as `json.dumps(...)` or after `from json import`)."""
    tree, found = ast.parse(source), []
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "json"
        for alias in node.names
        if alias.name in ("dump", "dumps")
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        by_module = (
            isinstance(func, ast.Attribute)
            and func.attr in ("dump", "dumps")
            and isinstance(func.value, ast.Name)
            and func.value.id == "json"
        )
        if by_module or (isinstance(func, ast.Name) and func.id in imported):
            found.append(node.lineno)
    return found


def _strict(text: str):
    """json.loads that refuses NaN and Infinity, as every JSON reader outside Python does."""

    def refuse(word):
        raise ValueError(f"{word} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_no_module_but_the_writer_calls_json_dump():
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != WRITER and (lines := json_writes(path.read_text()))
    }
    assert found == {}, f"write JSON through mha2gqa.files.jsontext.dumps: {found}"
    assert json_writes(WRITER.read_text())  # the walk finds the writer's own calls


def test_the_scan_finds_every_spelling():
    assert json_writes("import json\njson.dumps(1)\n") == [2]
    assert json_writes("import json\nwith open('f') as f:\n    json.dump({}, f)\n") == [3]
    assert json_writes("from json import dumps as d\nd(1)\n") == [2]
    assert json_writes("import yaml\nyaml.safe_dump({})\n") == []


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_number_is_written_as_null_at_any_depth(value):
    record = {"perplexity": value, "rows": [{"kl": value}, (1.5, value)], "ok": 2.0, "n": 3, "name": "NaN"}
    text = jsontext.dumps(record, indent=2)
    assert _strict(text) == {"perplexity": None, "rows": [{"kl": None}, [1.5, None]], "ok": 2.0, "n": 3, "name": "NaN"}
    with pytest.raises(ValueError, match="is not JSON"):
        _strict(json.dumps(record))  # what Python's default wrote: bare NaN / Infinity
    assert jsontext.shown(value) in ("NaN", "Infinity", "-Infinity")  # a message may quote it, never fails


def test_results_and_provenance_with_a_nan_are_valid_json(tmp_path):
    result = tmp_path / "r.json"
    write_result({"schema": "x", "perplexity": {"perplexity": math.nan}}, result)
    assert _strict(result.read_text())["perplexity"] == {"perplexity": None}
    (tmp_path / "m").mkdir()
    append(tmp_path / "m", "uptrain", {"loss": math.inf})
    assert _strict((tmp_path / "m" / FILE_NAME).read_text())


def test_a_converted_config_keeps_the_parents_infinite_setting(tmp_path):
    """A model's config.json is transformers' format, not a result: an infinite setting (falcon_h1's
    time_step_limit) stays Infinity, which transformers reads back; null made the child unloadable."""
    save_tiny_model(tmp_path / "src", "llama")
    config_path = tmp_path / "src" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "time_step_limit": [0.0, math.inf]}))
    convert(tmp_path / "src", tmp_path / "dst", 2, progress=False, check=False)
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["time_step_limit"] == [0.0, math.inf]
    assert jsontext.model_config({"a": math.inf}) == '{"a": Infinity}'
