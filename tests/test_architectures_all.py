"""Every causal-LM type of the installed transformers either converts exactly (to half its kv heads
on planted-redundant heads, and to one) or is refused in one line; never a crash.
docs/architectures.md is generated from the same outcomes (scripts/supported_architectures.py)."""

import json
import re
from pathlib import Path

import pytest
import transformers
from all_architectures import causal_lm_types, check_type

from mha2gqa.architecture.layouts import LAYOUTS, RETARGETED

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
    documented = [
        line.split("|")[1].strip(" `")
        for line in DOC.read_text().splitlines()
        if line.startswith("| `") and "| converts exactly |" in line
    ]
    generated_with = re.search(r"with transformers (\S+) \(", DOC.read_text())[1]
    if transformers.__version__ == generated_with:
        assert documented == exact, "docs/architectures.md is stale: run python scripts/supported_architectures.py"
    else:  # another release (the one vLLM pins, .ci/vllm): what the doc says converts still does, where it exists
        assert sorted(set(documented) & set(TYPES) - set(exact)) == [], (transformers.__version__, generated_with)


def _run(*args):
    from click.testing import CliRunner

    from mha2gqa.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def _save(model_type, path, weights=True):
    import torch
    from all_architectures import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def test_inspect_names_the_generic_layout_and_its_calibrated_support(tmp_path):
    result = _run("inspect", _save("mixtral", tmp_path / "mixtral"))
    assert result.exit_code == 0, result.output
    assert (
        "layout: generic, derived from the model class: attention at model.layers.N.self_attn "
        "(q_proj, k_proj, v_proj, o_proj); calibrated merge: supported" in result.output
    )
    result = _run("inspect", _save("cohere", tmp_path / "cohere"), "--json")
    info = json.loads(result.output)
    assert info["layout"].startswith("generic") and "rotate_half differs" in info["calibrated"]


def test_inspect_says_why_the_generic_layout_does_not_fit(tmp_path):
    result = _run("inspect", _save("deepseek_v3", tmp_path / "mla", weights=False))
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "generic one does not fit" in lines[0] and "(low-rank K/V as in MLA)" in lines[0]


def test_gpt2_converts_to_multi_query_only_and_inspect_offers_only_that(tmp_path):
    src = _save("gpt2", tmp_path / "gpt2")
    result = _run("convert", src, tmp_path / "out", "--groups", "2", "-q")
    assert result.exit_code == 2 and "only grouped form is multi-query attention; use --groups 1" in result.output
    assert not (tmp_path / "out").exists()
    info = json.loads(_run("inspect", src, "--json").output)
    assert [t["kv_heads"] for t in info["targets"]] == [8, 1]
    assert info["layout"] == "gpt2 converts to gpt_bigcode (multi-query only: --groups 1)"
    result = _run("convert", src, tmp_path / "mqa", "--groups", "1", "--dry-run", "--plan-tensors")
    assert result.exit_code == 0, result.output
    assert "transformer.h.0.mlp.c_fc.weight  F32 [256, 64]  <- transpose (Conv1D -> Linear)\n" in result.output
    assert "transformer.h.0.attn.c_attn.weight  F32 [80, 64]  <- mean over groups of 8 kv heads" in result.output


def test_calibrated_merge_is_refused_where_the_generic_layout_cannot_vouch_for_rope(tmp_path):
    from mha2gqa import convert
    from mha2gqa.runtime.errors import InputError

    src = _save("cohere", tmp_path / "cohere", weights=False)
    with pytest.raises(InputError, match="--method calibrated cannot convert model_type 'cohere': its rotate_half"):
        convert(src, tmp_path / "out", groups=1, method="calibrated", calibration="austen", progress=False)
    assert not (tmp_path / "out").exists()


def test_calibrated_merge_runs_on_a_generic_type_and_beats_mean_pooling(tmp_path):
    from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer
    from transformers import AutoModelForCausalLM

    from mha2gqa import convert

    src = _save("mixtral", tmp_path / "mixtral")
    make_tiny_tokenizer(src)
    (tmp_path / "calibration.txt").write_text(SAMPLE_TEXT * 20)
    errors = {}
    for method in ("mean", "calibrated"):
        result = convert(
            src,
            tmp_path / method,
            groups=2,
            method=method,
            calibration=str(tmp_path / "calibration.txt"),
            progress=False,
        )
        _, info = AutoModelForCausalLM.from_pretrained(tmp_path / method, output_loading_info=True)
        assert not any(info.values()), info
        errors[method] = [row["key_error"] + row["value_error"] for row in result.layers]
    assert len(errors["calibrated"]) == 2
    assert all(c < m for c, m in zip(errors["calibrated"], errors["mean"])), errors


def test_refine_runs_on_a_generic_type_and_is_refused_for_gpt2(tmp_path):
    from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer
    from transformers import AutoModelForCausalLM

    from mha2gqa import convert
    from mha2gqa.convert.refine import RefineOptions
    from mha2gqa.runtime.errors import InputError

    calibration = tmp_path / "calibration.txt"
    calibration.write_text(SAMPLE_TEXT * 20)
    src = _save("cohere", tmp_path / "cohere")  # RoPE convention unknown to the merge; refine folds nothing
    make_tiny_tokenizer(src)
    result = convert(
        src, tmp_path / "refined", groups=2, calibration=str(calibration), refine=RefineOptions(steps=2), progress=False
    )
    AutoModelForCausalLM.from_pretrained(tmp_path / "refined")
    assert all(row["fit_error_after"] < row["fit_error_before"] for row in result.refine["layers"]), result.refine
    gpt2 = _save("gpt2", tmp_path / "gpt2", weights=False)
    with pytest.raises(InputError, match="--refine cannot refine model_type 'gpt2'"):
        convert(gpt2, tmp_path / "mqa", groups=1, calibration=str(calibration), refine=RefineOptions(), progress=False)


def test_similarity_grouping_finds_scattered_groups_on_a_generic_type(tmp_path):
    """mixtral (generic layout): kv heads {0, 3, 5, 6} and {1, 2, 4, 7} planted identical; similarity
    grouping reorders heads (q rows and o columns with them) so that mean pooling to 2 is exact."""
    import torch
    from all_architectures import IDS, plant_redundant_groups, tiny_config
    from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer
    from transformers import AutoModelForCausalLM

    from mha2gqa import convert
    from mha2gqa.architecture.layouts import attention_shape, layout_for

    torch.manual_seed(0)
    parent = AutoModelForCausalLM.from_config(tiny_config("mixtral")).eval()
    config = parent.config.to_dict()
    layout, shape = layout_for(config), attention_shape(config)
    plant_redundant_groups(parent, layout, shape, [[0, 3, 5, 6], [1, 2, 4, 7]])
    with torch.no_grad():
        expected = parent(IDS).logits
    parent.save_pretrained(tmp_path / "src")
    make_tiny_tokenizer(tmp_path / "src")
    (tmp_path / "calibration.txt").write_text(SAMPLE_TEXT * 8)
    logits = {}
    for grouping in ("contiguous", "similarity"):
        result = convert(
            tmp_path / "src",
            tmp_path / grouping,
            groups=2,
            calibration=str(tmp_path / "calibration.txt"),
            calibration_tokens=400,
            grouping=grouping,
            progress=False,
        )
        with torch.no_grad():
            logits[grouping] = AutoModelForCausalLM.from_pretrained(tmp_path / grouping).eval()(IDS).logits
    assert [row["kv_order"] for row in result.layers] == [[0, 3, 5, 6, 1, 2, 4, 7]] * 2
    torch.testing.assert_close(logits["similarity"], expected, rtol=1e-4, atol=1e-5)
    assert (logits["contiguous"] - expected).abs().max() > 1e-3
