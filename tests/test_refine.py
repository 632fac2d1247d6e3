"""convert --refine as a conversion: runs are deterministic with --seed (and the same when the activations
spill to disk), the output is a stock checkpoint of the merged shapes, every layout refines, bad flags are
refused, and the bench runs. What each stage guarantees (exact stays exact, each stage beats the one before on
held-out text, cost linear in depth) is tests/test_refine_stages.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from tiny_models import make_tiny_tokenizer, save_tiny_model
from transformers import AutoModelForCausalLM

from mha2gqa.cli import main
from mha2gqa.convert.refine import RefineOptions
from mha2gqa.convert.run import convert
from mha2gqa.records.provenance import latest
from mha2gqa.runtime.errors import InputError

SMALL = dict(max_position_embeddings=64)  # refine blocks are min(512, context) tokens: 64 here
FAST = RefineOptions(steps=30, lr=3e-3, batch_blocks=4)
OTHER_TEXT = (
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement, "
    "never took up any book but the Baronetage; there he found occupation for an idle hour.\n"
)


def logits(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def heldout_ids(src):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(src)(OTHER_TEXT * 2, add_special_tokens=False)["input_ids"][:64]
    return torch.tensor([ids])


def test_deterministic_with_seed_and_same_when_spilled_to_disk(tmp_path, tiny_src, calibration_file, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # tempfile reads TMPDIR once: reset its cache too
    monkeypatch.setattr("tempfile.tempdir", None)
    runs = {}
    for name, memory in [("a", FAST.memory), ("b", FAST.memory), ("spill", 1)]:
        options = RefineOptions(**{**FAST.__dict__, "memory": memory})
        result = convert(
            tiny_src,
            tmp_path / name,
            1,
            method="mean",
            calibration=calibration_file,
            calibration_tokens=1024,
            refine=options,
            progress=False,
        )
        assert result.refine["spilled_to_disk"] == (name == "spill")
        runs[name] = load_file(tmp_path / name / "model.safetensors")
    assert not list(tmp_path.rglob("*.f32")) and not list(tmp_path.rglob(".refine-*"))  # the spill files are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "spill"]  # nothing under $TMPDIR either
    for name in ("b", "spill"):
        assert runs[name].keys() == runs["a"].keys()
        for key, tensor in runs["a"].items():
            assert torch.equal(runs[name][key], tensor), (name, key)
    other = convert(
        tiny_src,
        tmp_path / "seed1",
        1,
        method="mean",
        calibration=calibration_file,
        calibration_tokens=1024,
        refine=RefineOptions(**{**FAST.__dict__, "seed": 1}),
        progress=False,
    )
    assert other.refine["layers"] != latest(tmp_path / "a", "conversion")["refine"]["layers"]
    seed1 = load_file(tmp_path / "seed1" / "model.safetensors")
    assert any(not torch.equal(seed1[key], tensor) for key, tensor in runs["a"].items())


def test_output_is_a_stock_checkpoint_of_the_merged_shapes(tmp_path, tiny_src, calibration_file):
    # From mean-pooling: the tiny model's calibrated merge is within 0.2% of its parent on the blocks, so close
    # that a refit that also fits the openings' first positions may not beat it, and is then left as merged.
    convert(
        tiny_src,
        tmp_path / "merged",
        2,
        method="mean",
        calibration=calibration_file,
        calibration_tokens=1024,
        progress=False,
    )
    convert(
        tiny_src,
        tmp_path / "refined",
        2,
        method="mean",
        calibration=calibration_file,
        calibration_tokens=1024,
        refine=FAST,
        progress=False,
    )
    merged, refined = (load_file(tmp_path / n / "model.safetensors") for n in ("merged", "refined"))
    assert {k: v.shape for k, v in merged.items()} == {k: v.shape for k, v in refined.items()}
    changed = {k for k in merged if not torch.equal(merged[k], refined[k])}
    assert changed and all(".self_attn." in k for k in changed)  # only attention values change
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "refined", output_loading_info=True)
    assert not any(info.values()), info
    assert model.config.num_key_value_heads == 2


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2", "stablelm", "phi3", "phi", "gemma2"])
def test_every_layout_refines(tmp_path, calibration_file, model_type):
    """Refine trains the attention module as transformers runs it, norms included: fused qkv (phi3),
    per-head key norms (stablelm), norms before RoPE that the calibrated merge refuses (qwen3, olmo2)."""
    src = tmp_path / "src"
    save_tiny_model(src, model_type, **SMALL)
    make_tiny_tokenizer(src)
    result = convert(
        src,
        tmp_path / "dst",
        2,
        method="mean",
        calibration=calibration_file,
        calibration_tokens=1024,
        refine=FAST,
        progress=False,
    )
    rows = result.refine["layers"]
    assert all(r["heldout_error_after"] <= r["heldout_error_before"] for r in rows), rows
    assert any(r["heldout_error_after"] < r["heldout_error_before"] for r in rows), rows
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", output_loading_info=True)
    assert not any(info.values()) and model.config.num_key_value_heads == 2


def test_refusals_are_one_line_and_write_nothing(tmp_path, tiny_src, calibration_file):
    runner = CliRunner()
    cases = [
        (["--refine", "--calibration-tokens", "64"], "--refine needs at least 2 calibration blocks"),
        (
            ["--refine", "--calibration", calibration_file, "--refine-steps", "-1"],
            "--refine-steps -1 must be 0 or more",
        ),
        (
            ["--refine", "--calibration", calibration_file, "--refine-lr", "0"],
            "--refine-lr 0.0 must be a finite positive",
        ),
        (["--refine", "--calibration", calibration_file, "--refine-lr", "inf"], "--refine-lr inf must be a finite"),
        (["--refine", "--calibration", calibration_file, "--refine-lr", "nan"], "--refine-lr nan must be a finite"),
        (
            ["--refine", "--calibration", calibration_file, "--refine-lr", "-1e-3"],
            "--refine-lr -0.001 must be a finite",
        ),
        (
            ["--refine", "--calibration", calibration_file, "--calibration-tokens", "0"],
            "--calibration-tokens 0 must be",
        ),
        (["--calibration", calibration_file, "--calibration-tokens", "-5"], "--calibration-tokens -5 must be"),
        (
            ["--refine", "--calibration", calibration_file, "--calibration-tokens", "64"],
            "at least 2 calibration blocks",
        ),
        (["--refine", "--calibration", "/nonexistent/cal.txt"], "--calibration /nonexistent/cal.txt: no such file"),
        (
            ["--refine", "--calibration", calibration_file, "--refine-memory", "lots"],
            "--refine-memory 'lots' is not a size",
        ),
        (["--refine", "--calibration", calibration_file, "--refine-tokens", "0"], "--refine-tokens 0 must be positive"),
    ]
    for extra, message in cases:  # refused before DST, its lock or any statistics exist
        result = runner.invoke(main, ["convert", str(tiny_src), str(tmp_path / "dst"), "-g", "2", *extra])
        assert result.exit_code == 2, result.output
        assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
        assert sorted(p.name for p in tmp_path.iterdir()) == [], (extra, list(tmp_path.iterdir()))
    with pytest.raises(InputError, match="at least 2 calibration blocks"):
        convert(
            tiny_src,
            tmp_path / "dst",
            2,
            calibration=calibration_file,
            calibration_tokens=64,
            refine=FAST,
            progress=False,
        )
    assert not (tmp_path / "dst").exists()


def test_cli_refine_prints_errors(tmp_path, tiny_src, calibration_file):
    result = CliRunner().invoke(
        main,
        [
            "convert",
            str(tiny_src),
            str(tmp_path / "dst"),
            "-g",
            "2",
            "--method",
            "calibrated",
            "--grouping",
            "similarity",
            "--calibration",
            calibration_file,
            "--calibration-tokens",
            "1024",
            "--refine",
            "--refine-steps",
            "10",
            "--refine-lr",
            "0.003",
            "--refine-tokens",
            "256",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "refine: relative attention-output error" in result.output
    record = latest(tmp_path / "dst", "conversion")["refine"]
    assert record["options"]["steps"] == 10 and record["options"]["tokens"] == 256 and len(record["layers"]) == 2
    assert (record["fit_tokens"], record["heldout_tokens"]) == (192, 64)  # 4 of the 16 blocks of 64: 3 fit, 1 held out


def test_default_refine_tokens_scale_with_hidden_size(tmp_path, tiny_src, calibration_file):
    """Unset, --refine uses 128 x hidden tokens (a tiny model with hidden 8 -> 1,024: 16 blocks of 64, of the 2,048
    calibration tokens)."""
    src = tmp_path / "src"
    save_tiny_model(src, "llama", hidden_size=8, num_attention_heads=4, num_key_value_heads=4, **SMALL)
    make_tiny_tokenizer(src)
    record = convert(
        src,
        tmp_path / "dst",
        2,
        calibration=calibration_file,
        calibration_tokens=2048,
        refine=RefineOptions(steps=2),
        progress=False,
    ).refine
    assert record["options"]["tokens"] is None
    assert record["fit_tokens"] + record["heldout_tokens"] == 128 * 8


@pytest.mark.slow  # ~2 minutes on 2 busy cores: four CLI conversions of the embedded model
def test_bench_smoke(tmp_path):
    out = tmp_path / "refine.json"
    bench = Path(__file__).resolve().parent.parent / "bench" / "refine.py"
    subprocess.run(
        [sys.executable, str(bench), "--smoke", "--out", str(out)], check=True, timeout=600, capture_output=True
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(r["method"], r["refine"]) for r in rows} == {
        ("mean", False),
        ("mean", True),
        ("calibrated", False),
        ("calibrated", True),
    }
    for row in rows:
        assert row["perplexity"] > 1 and row["convert_s"] > 0 and row["peak_rss_mib"] > 0


def test_bench_timing_smoke(tmp_path):
    """bench/refine.py --timing: calibration and refinement side by side, medians of the rounds."""
    out = tmp_path / "timing.json"
    bench = Path(__file__).resolve().parent.parent / "bench" / "refine.py"
    subprocess.run(
        [sys.executable, str(bench), "--smoke", "--timing", "1", "--methods", "calibrated", "--out", str(out)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    (round_,) = result["rounds"]
    assert round_["calibration_s"] > 0 and round_["refine_s"] > 0 and round_["refine_cpu_s"] > 0
    # The ratio is rounded from the unrounded seconds, the seconds to 0.01 each: allow for both roundings.
    ratio = round_["refine_s"] / round_["calibration_s"]
    slack = 0.005 + ratio * (0.005 / round_["calibration_s"] + 0.005 / round_["refine_s"])
    assert round_["ratio_wall"] == pytest.approx(ratio, abs=slack)
    assert result["medians"]["ratio_wall"] == round_["ratio_wall"] and result["kv_heads"] == 2  # --smoke: kv 2
