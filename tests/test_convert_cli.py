"""The CLI: bad input gives one line and exit code 2 with nothing written or lost; inspect's numbers;
one real subprocess run."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from tiny_models import save_tiny_model
from transformers import AutoModelForCausalLM

from mha2gqa.cli import main


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "src"
    save_tiny_model(path, "llama")
    return path


def _tree_digest(path):
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


BAD_INPUTS = [
    (["--groups", "3"], "--groups 3 must divide num_key_value_heads=8 (valid: 1, 2, 4)"),
    (["--groups", "8"], "equals the source's num_key_value_heads=8"),
    (["--groups", "0"], "must divide num_key_value_heads=8"),
    (
        ["--groups", "2", "--method", "median"],
        "'median' is not one of 'mean', 'first', 'random', 'mean-norm', 'calibrated'",
    ),
    (["--groups", "2", "--dtype", "int8"], "--dtype 'int8' is unknown"),
    (["--groups", "2", "--max-shard-size", "lots"], "--max-shard-size 'lots' is not a size"),
    (["--groups", "two"], "'two' is not a valid integer"),
]


@pytest.mark.parametrize("flags,message", BAD_INPUTS)
def test_bad_flags_exit_2_with_one_line_and_write_nothing(src, tmp_path, flags, message):
    before = _tree_digest(src)
    result = _run("convert", src, tmp_path / "dst", *flags)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.output
    assert not (tmp_path / "dst").exists()
    assert _tree_digest(src) == before


def test_destination_inside_equal_to_or_containing_source_is_refused(src):
    before = _tree_digest(src)
    for dst, message in ((src / "gqa", "inside SRC"), (src, "inside SRC"), (src.parent, "contains SRC")):
        result = _run("convert", src, dst, "--groups", "2", "--force")
        assert result.exit_code == 2 and message in result.output, result.output
    assert _tree_digest(src) == before
    assert not (src / "gqa").exists()


def test_non_empty_destination_needs_force(src, tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    result = _run("convert", src, tmp_path / "dst", "--groups", "2")
    assert result.exit_code == 2 and "pass --force" in result.output
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["keep.txt"]


def test_pickled_weights_are_refused_with_the_fix(tmp_path):
    save_tiny_model(tmp_path / "src", "llama")
    (tmp_path / "src" / "model.safetensors").rename(tmp_path / "src" / "pytorch_model.bin")
    result = _run("convert", tmp_path / "src", tmp_path / "dst", "--groups", "2")
    assert result.exit_code == 2
    assert "never unpickles" in result.output and "save_pretrained" in result.output
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "model_type,reason",
    [
        ("gpt_neox", "no grouped-query attention"),
        ("falcon", "saves no memory"),
        ("mamba", "the generic one does not fit: its config has no"),
    ],
)
def test_unsupported_architectures_list_the_supported_ones(tmp_path, model_type, reason):
    (tmp_path / "src").mkdir()
    config = {"model_type": model_type, "num_attention_heads": 8, "hidden_size": 64, "num_hidden_layers": 2}
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    result = _run("convert", tmp_path / "src", tmp_path / "dst", "--groups", "2")
    assert result.exit_code == 2
    assert reason in result.output
    if model_type != "mamba":  # known families list the explicit entries; unknown ones say why the generic one fails
        assert "supported: gemma, gemma2, granite, llama" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_missing_path_and_offline_hub_id_are_one_line_errors(tmp_path):
    result = _run("convert", tmp_path / "nowhere", tmp_path / "dst", "--groups", "2")
    assert result.exit_code == 2 and "no such directory" in result.output
    result = _run("convert", "meta-llama/Llama-2-7b-hf", tmp_path / "dst", "--groups", "8")
    assert result.exit_code == 2 and "hub is offline" in result.output
    assert not (tmp_path / "dst").exists()


def test_dry_run_prints_the_summary_first_and_the_tensors_on_request(src, tmp_path):
    """What would be written, the stages, memory and time lead; the per-tensor mapping follows with
    --plan-tensors only (a real model has hundreds of tensors)."""
    result = _run("convert", src, tmp_path / "dst", "--groups", "2", "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"would write {tmp_path / 'dst'}: ") and "kv heads 8 -> 2 by mean" in lines[0]
    assert lines[1].startswith(f"checked: {tmp_path} is writable and has ")  # what the run checks first (issue 38)
    assert [line.split(":")[0] for line in lines[2:7]] == ["stage 1", "stage 2", "stage 3", "estimates", "time"]
    assert lines[3].startswith("stage 2: check: ")  # the quality check after the write, listed with the rest
    assert lines[7] == "(--plan-tensors lists the 29 output tensors, each with its source)" and len(lines) == 8
    listed = _run("convert", src, tmp_path / "dst", "--groups", "2", "--dry-run", "--plan-tensors").output.splitlines()
    assert listed[:7] == lines[:7] and len(listed) == 7 + 29
    k_proj = "model.layers.0.self_attn.k_proj.weight  F32 [16, 64]  <- mean over groups of 4 kv heads of layer 0 ("
    assert any(line.startswith(k_proj) for line in listed[7:])
    assert "model.embed_tokens.weight  F32 [128, 64]  <- copy" in listed
    assert not (tmp_path / "dst").exists()


def test_inspect_reports_kv_bytes_and_parameters_of_every_target(src, tmp_path):
    result = _run("inspect", src, "--json", "--context", "100", "--batch", "3")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert (info["layers"], info["heads"], info["kv_heads"], info["head_dim"]) == (2, 8, 8, 8)
    by_groups = {t["kv_heads"]: t for t in info["targets"]}
    assert sorted(by_groups) == [1, 2, 4, 8]
    assert by_groups[8]["kv_bytes_per_token"] == 2 * 2 * 8 * 8 * 4
    assert by_groups[2]["kv_bytes_per_batch"] == 2 * 2 * 2 * 8 * 4 * 100 * 3
    assert by_groups[2]["saving"] == 4
    _run("convert", src, tmp_path / "gqa2", "--groups", "2", "-q")
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "gqa2")
    assert by_groups[2]["parameters"] == sum(p.numel() for p in converted.parameters())
    table = _run("inspect", src).output
    assert "kv heads" in table and "4x" in table and "8 (now)" in table


def test_the_installed_command_runs_as_a_subprocess(src, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "mha2gqa", "convert", str(src), str(tmp_path / "dst"), "--groups", "4", "-q"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kv heads 8 -> 4 by mean" in done.stdout
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["num_key_value_heads"] == 4
    bad = subprocess.run(command[:-3] + ["--groups", "5"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "valid: 1, 2, 4" in bad.stderr


def test_inspect_measures_a_sequence_at_the_models_own_context(src, tmp_path):
    from mha2gqa.files.embedded import model_dir

    result = _run("inspect", model_dir())  # max_position_embeddings 512
    assert result.exit_code == 0, result.output
    assert "KV/seq@512" in result.output and "6.00 MiB" in result.output  # 12 KiB per token x 512
    assert "KV/seq at 512 tokens (config max_position_embeddings)" in result.output
    info = json.loads(_run("inspect", model_dir(), "--json").output)
    assert (info["context"], info["targets"][0]["kv_bytes_per_sequence"]) == (512, 12 * 1024 * 512)
    no_context = tmp_path / "no-context"
    no_context.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.pop("max_position_embeddings", None)
    (no_context / "config.json").write_text(json.dumps(config))
    (no_context / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    info = json.loads(_run("inspect", no_context, "--json").output)
    assert info["context"] == 4096 and info["context_from"] == "default: the config names no context length"


def test_convert_takes_the_same_thread_count_on_a_busy_machine_and_records_it(tiny_src, tmp_path, monkeypatch):
    """Float sums differ with torch's thread count, so the count may not follow the load (the card promises
    the same bytes from its command): a busy machine converts with the quiet one's count, recorded."""
    import torch

    quiet_count = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MHA2GQA_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))  # every core taken
    try:
        result = _run("convert", tiny_src, tmp_path / "dst", "-g", "2", "--method", "calibrated", "--calibration-tokens",
                      "256", "--calibration", "austen", "--quiet")  # fmt: skip
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == quiet_count
    finally:
        torch.set_num_threads(quiet_count)
    record = json.loads((tmp_path / "dst" / "mha2gqa.json").read_text())["lineage"][-1]
    assert record["torch_threads"] == quiet_count
    card = (tmp_path / "dst" / "README.md").read_text()
    assert f"this ran with {quiet_count} (mha2gqa --threads {quiet_count} convert ...)" in card
