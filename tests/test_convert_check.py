"""convert's quality check (convert/check.py, check_run.py, check_cache.py): the verdicts on models made to be close, lossy
and broken, the table in the terminal, mha2gqa.json and the card, the parent's cache, and the skips."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from mha2gqa import convert
from mha2gqa.cli import main
from mha2gqa.convert import check_run
from mha2gqa.convert.check import (
    CLOSE,
    CPU_CHECK_BUDGET_S,
    NOT_USABLE,
    USABLE,
    next_steps,
    plan_check,
    verdict,
)
from mha2gqa.files import embedded
from mha2gqa.scoring.kl import kl_divergence
from mha2gqa.uptrain.recipe_load import load_recipe, shipped_recipes


def test_verdict_of_each_kind_from_the_ratios():
    assert verdict({"prose": 1.02, "code": 1.09}).kind == CLOSE
    usable = verdict({"prose": 1.05, "code": 1.8, "licences": 1.2})
    assert usable.kind == USABLE and usable.lossy == ("code", "licences")
    assert usable.line == "usable, with losses on code 1.80x, licences 1.20x"
    # one domain above 2x, or a geometric mean above 1.5x, is not usable however good the rest
    assert verdict({"prose": 1.0, "code": 2.1}).kind == NOT_USABLE
    assert verdict({"prose": 1.6, "code": 1.6}).kind == NOT_USABLE
    broken = verdict({"prose": 1.0, "code": None})
    assert broken.kind == NOT_USABLE and "code" in broken.line and "not finite" in broken.line


def test_next_steps_name_the_recipe_for_the_device_and_the_refined_conversion_when_not_done():
    steps = next_steps(NOT_USABLE, "my parent", "out", ["--groups", "2"], False, "cpu")
    assert steps[0] == (
        "mha2gqa uptrain --recipe distill-parent-cpu model=out distill.teacher='my parent' output_dir=out-uptrained"
    )
    assert steps[1] == "mha2gqa convert 'my parent' out-refined --groups 2 --method calibrated --refine"
    assert next_steps(NOT_USABLE, "p", "o", ["--groups", "1"], True, "cuda")[0].startswith(
        "mha2gqa uptrain --recipe distill-parent-gpu"
    )
    assert (
        len(next_steps(USABLE, "p", "o", ["--groups", "1"], True, "cpu")) == 1
    )  # already calibrated + refined: uptrain only
    assert next_steps(CLOSE, "p", "o", ["--groups", "1"], False, "cpu") == []


@pytest.mark.parametrize("name", ["distill-parent-cpu", "distill-parent-gpu"])
def test_the_recipes_the_check_names_ship_in_the_package_and_load_by_name(name, tmp_path):
    assert name in shipped_recipes()
    recipe = load_recipe(name, ["model=m", "distill.teacher=t", f"output_dir={tmp_path}"], validate_files=False)
    assert recipe.data.train == ["parent"] and recipe.distill.kl_weight == 1.0
    first = (Path(check_run.__file__).parents[1] / "uptrain" / "recipes" / f"{name}.yaml").read_text()
    assert first.startswith(f"# mha2gqa uptrain --recipe {name} ")


def test_the_kl_against_top_tokens_is_kls_full_kl_with_every_token_and_a_lower_bound_with_fewer():
    from mha2gqa.scoring.agreement import AgreementTally, top_tokens

    torch.manual_seed(0)
    parent, child = torch.randn(5, 40) * 3, torch.randn(5, 40) * 3
    exact = kl_divergence(parent, child, reduction="none")
    full, every = AgreementTally(), AgreementTally()
    full.add(parent, child)
    every.add_top(top_tokens(parent, 40), child)
    assert every.result() == pytest.approx(full.result(), rel=1e-5)
    fewer = AgreementTally()
    fewer.add_top(top_tokens(parent, 8), child)
    assert 0 < fewer.result()["kl_mean"] <= exact.mean().item() + 1e-6
    assert fewer.result()["top1_agreement"] == full.result()["top1_agreement"]


def test_a_large_model_on_cpu_is_skipped_with_one_line_and_a_gpu_runs_it():
    config = {"max_position_embeddings": 4096}
    slow = plan_check(config, 7_000_000_000, True, CPU_CHECK_BUDGET_S + 1, device="cpu")
    assert slow.skip.startswith("a 7.0B-parameter model's check would take about 3 min on this CPU")
    assert "mha2gqa eval DST --reference SRC" in slow.skip
    assert plan_check(config, 7_000_000_000, True, CPU_CHECK_BUDGET_S + 1, device="cuda").skip is None
    assert plan_check(config, 1, False, 1, device="cpu").skip == "--no-check"
    assert plan_check({"max_position_embeddings": 64}, 1, True, 1, device="cpu").window == 64


def _convert_cli(tmp_path, name, *args):
    result = CliRunner().invoke(main, ["convert", str(embedded.model_dir()), str(tmp_path / name), "-q", *args])
    assert result.exit_code == 0, result.output
    return result.output, json.loads((tmp_path / name / "mha2gqa.json").read_text())["lineage"][-1]["check"]


def _ratios(record):
    return {name: row["ratio"] for name, row in record["domains"].items()}


def test_a_broken_conversion_is_not_usable_and_says_what_to_run(tmp_path, monkeypatch):
    """The embedded model pooled to one kv head with random K/V: every domain far above its parent."""
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    out, record = _convert_cli(tmp_path, "random", "-g", "1", "--method", "random")
    assert record["verdict"] == NOT_USABLE and min(_ratios(record).values()) > 1.5
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("check: what DST kept"))
    assert re.split(r"\s{2,}", lines[start + 1]) == [
        "domain",
        "SRC perplexity",
        "DST perplexity",
        "ratio",
        "KL",
        "top-1",
    ]
    assert [line.split()[0] for line in lines[start + 3 : start + 7]] == ["prose", "code", "python_docs", "licences"]
    assert lines[start + 7].startswith("verdict: not usable without uptraining (geometric mean ")
    assert lines[start + 8].startswith("next: mha2gqa uptrain --recipe distill-parent-cpu model=")
    assert lines[start + 9].startswith("  or: mha2gqa convert ") and "--method calibrated --refine" in lines[start + 9]
    card = (tmp_path / "random" / "README.md").read_text()
    assert "## What it kept" in card and "**Verdict: not usable without uptraining" in card
    assert "mha2gqa uptrain --recipe distill-parent-cpu" in card
    for row in record["domains"].values():  # KL and top-1 are numbers of the right kind
        assert row["kl_mean"] > 0 and 0 <= row["top1_agreement"] < 1 and row["tokens"] == 511


def test_a_lossy_conversion_is_usable_with_its_losses_named(tmp_path, monkeypatch):
    """Mean-pooling the embedded model's 8 kv heads to 4: every domain loses some, none is broken."""
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    out, record = _convert_cli(tmp_path, "mean4", "-g", "4")
    ratios = _ratios(record)
    assert record["verdict"] == USABLE and max(ratios.values()) <= 2 and max(ratios.values()) > 1.1
    worst = max(ratios, key=ratios.get)
    assert f"verdict: usable, with losses on {worst} {ratios[worst]:.2f}x" in out
    assert "next: mha2gqa uptrain --recipe distill-parent-cpu" in out and "  or: " in out


def test_a_conversion_that_changes_nothing_is_close_and_the_parent_comes_from_the_cache(tmp_path, monkeypatch):
    """kv heads made identical within each group: pooling them changes no logit, so every ratio is 1."""
    from tiny_models import make_tiny_tokenizer, save_tiny_model

    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    save_tiny_model(src, "llama", max_position_embeddings=64)
    make_tiny_tokenizer(src)
    _plant_identical_kv_heads(src, groups=2)
    first = convert(src, tmp_path / "a", 2, progress=False)
    assert first.check["verdict"] == CLOSE and first.check["parent_cached"] is False and first.check["next"] == []
    for row in first.check["domains"].values():
        assert math.isclose(row["ratio"], 1.0, rel_tol=1e-4) and row["kl_mean"] < 1e-6 and row["top1_agreement"] == 1.0
    assert first.check["top_k"] == 128  # the whole vocabulary of the tiny model: the KL is the full one
    again = convert(src, tmp_path / "b", 2, progress=False)
    assert again.check["parent_cached"] is True and _ratios(again.check) == _ratios(first.check)
    # a damaged cache file is not trusted: the parent is scored again, to the same numbers
    for path in (tmp_path / "cache" / "check").iterdir():
        path.write_bytes(b"not safetensors")
    third = convert(src, tmp_path / "c", 2, progress=False)
    assert third.check["parent_cached"] is False and _ratios(third.check) == _ratios(first.check)


def _plant_identical_kv_heads(model_dir: Path, groups: int) -> None:
    from all_architectures import plant_redundant_groups
    from transformers import AutoModelForCausalLM

    from mha2gqa.architecture.layouts import attention_shape, layout_for, read_config

    config = read_config(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    plant_redundant_groups(model, layout_for(config), attention_shape(config), groups)
    model.save_pretrained(model_dir)


def test_no_tokenizer_and_no_check_skip_it_in_one_line(tmp_path, monkeypatch):
    from tiny_models import save_tiny_model

    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "bare"
    save_tiny_model(src, "llama")
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "a"), "-g", "2", "-q"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "check: skipped (SRC has no tokenizer to read the probe texts with)"
    record = json.loads((tmp_path / "a" / "mha2gqa.json").read_text())["lineage"][-1]["check"]
    assert record == {"skipped": "SRC has no tokenizer to read the probe texts with"}
    assert "Not checked at conversion: SRC has no tokenizer" in (tmp_path / "a" / "README.md").read_text()
    off = CliRunner().invoke(main, ["convert", str(embedded.model_dir()), str(tmp_path / "b"), "-g", "2", "--no-check"])
    assert off.exit_code == 0 and "check: skipped (--no-check)" in off.output.splitlines()
    assert not (tmp_path / "cache").exists()
