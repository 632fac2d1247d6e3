"""ConvertOptions / EvalOptions: typed, torch-free, and the keyword APIs still build them (their field docstrings:
tests/test_docfields.py)."""

import json
import subprocess
import sys

import pytest

from mha2gqa.convert.options import ConvertOptions, Grouping, Method
from mha2gqa.eval.options import EvalOptions, SpeedPreset
from mha2gqa.runtime.errors import InputError


def test_enums_are_strings_with_the_same_json_and_text():
    options = ConvertOptions(groups=2, method="mean-norm", grouping="similarity")
    assert options.method is Method.MEAN_NORM and options.method == "mean-norm"
    assert options.grouping is Grouping.SIMILARITY
    assert f"{options.method} {options.grouping}" == "mean-norm similarity"
    assert json.dumps({"m": options.method, "s": SpeedPreset.OFF}) == '{"m": "mean-norm", "s": "off"}'


def test_unknown_values_and_keywords_are_refused():
    with pytest.raises(
        InputError, match=r"--method 'avg' is unknown \(valid: mean, first, random, mean-norm, calibrated\)"
    ):
        ConvertOptions(groups=2, method="avg")
    with pytest.raises(InputError, match="--grouping 'best' is unknown"):
        ConvertOptions(groups=2, grouping="best")
    with pytest.raises(TypeError, match="'grups'"):
        ConvertOptions.from_kwargs(2, {"grups": 2})
    with pytest.raises(TypeError, match="'speed'"):
        EvalOptions.from_kwargs({"speed": "off"})


def test_speed_off_spellings():
    assert [EvalOptions(speed_preset=p).speed for p in (None, False, "off", SpeedPreset.OFF)] == [None] * 4
    assert EvalOptions().speed == "auto" and EvalOptions(speed_preset="cpu").speed == "cpu"


def test_convert_with_options_matches_keywords(tmp_path):
    from tiny_models import save_tiny_model

    from mha2gqa import convert

    save_tiny_model(tmp_path / "src", "llama")
    by_keywords = convert(tmp_path / "src", tmp_path / "a", groups=2, method="first", dry_run=True, progress=False)
    by_options = convert(tmp_path / "src", tmp_path / "b", options=ConvertOptions(2, Method.FIRST, dry_run=True))
    assert by_keywords.tensors.method == by_options.tensors.method == "first"
    assert type(by_options.tensors.method) is str  # plain text in mha2gqa.json and the printed plan
    with pytest.raises(TypeError, match="not both"):
        convert(tmp_path / "src", tmp_path / "c", 2, options=ConvertOptions(2))


def test_options_modules_import_no_torch():
    code = "import sys, mha2gqa.convert.options, mha2gqa.eval.options; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_result_accessors_read_measured_sections_and_none_otherwise():
    from mha2gqa.eval import schema

    measured = {
        "perplexity": {"perplexity": 12.5, "context": 64, "stride": 32},
        "data": {"ids_sha256": "ab"},
        "agreement": {"kl_mean": 0.1, "top1_agreement": 0.9},
        "kv_cache": {"measured_bytes_per_token": 512, "match": True},
        "speed": {"points": [{"batch": 1}]},
        "env": {"device_name": "cpu"},
        "lm_eval": {"tasks": {"t": {"metrics": {"acc": {"value": 0.5, "stderr": None}, "f1": {"value": None}}}}},
    }
    assert (schema.perplexity(measured), schema.perplexity_window(measured), schema.data_digest(measured)) == (
        12.5,
        (64, 32),
        "ab",
    )
    assert (schema.kl_mean(measured), schema.top1_agreement(measured)) == (0.1, 0.9)
    assert (schema.kv_bytes_per_token(measured), schema.kv_match(measured)) == (512, True)
    assert schema.speed_points(measured) == [{"batch": 1}] and schema.device_name(measured) == "cpu"
    assert schema.lm_eval_metric(measured, "t", "acc") == {"value": 0.5, "stderr": None}
    assert schema.lm_eval_metric(measured, "t", "f1") is None and schema.lm_eval_metric(measured, "u", "acc") is None
    skipped = dict.fromkeys(measured)
    assert schema.perplexity(skipped) is None and schema.perplexity_window(skipped) == (None, None)
    assert (
        schema.speed_points(skipped) == [] and schema.lm_eval_tasks(skipped) == {} and schema.kv_match(skipped) is None
    )
