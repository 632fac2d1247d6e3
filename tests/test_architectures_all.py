"""Every causal-LM type of the installed transformers either converts exactly (to half its kv heads
on planted-redundant heads, and to one) or is refused in one line; never a crash.
docs/architectures.md is generated from the same outcomes (scripts/supported_architectures.py)."""

from pathlib import Path

import pytest

from all_architectures import causal_lm_types, check_type
from mha2gqa.layouts import LAYOUTS, RETARGETED

TYPES = causal_lm_types()
DOC = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
_outcomes = {}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    def get(model_type):
        if model_type not in _outcomes:
            _outcomes[model_type] = check_type(model_type, tmp_path_factory.mktemp(model_type))
        return _outcomes[model_type]

    return get


@pytest.mark.parametrize("model_type", TYPES)
def test_type_converts_exactly_or_is_refused_in_one_line(outcome, model_type):
    result = outcome(model_type)  # check_type asserts the exact match and the clean one-line refusal
    if model_type in LAYOUTS or model_type in RETARGETED:
        assert result.status == "exact", result
    assert result.status in ("exact", "refused", "no tiny model"), result
    if result.status != "exact":
        assert result.reason and "\n" not in result.reason


def test_enough_types_convert_and_the_documented_list_matches(outcome):
    exact = sorted(t for t in TYPES if outcome(t).status == "exact")
    assert len(exact) >= 40, exact
    documented = [line.split("|")[1].strip(" `") for line in DOC.read_text().splitlines()
                  if line.startswith("| `") and "| converts exactly |" in line]
    assert documented == exact, "docs/architectures.md is stale: run python scripts/supported_architectures.py"
