"""Paths and values are refused before torch is imported: a missing `eval --data` file took 13-69 s to be
refused on a busy machine, because torch started first. Each case runs the command in a fresh interpreter
and asserts the one Error line, exit code 2 and that torch (and transformers) were never imported: what
was imported can fail a test, a wall time would depend on the machine (bench/cli_startup.py times it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import cli
from tiny_models import SAMPLE_TEXT
from uptrain_helpers import tiny_model_dir

from mha2gqa.files import embedded

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, sys
from mha2gqa.cli import main
try:
    main({args!r})
except SystemExit as done:
    code = done.code
print(json.dumps({{"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}}))
"""


def run_without_torch(*args) -> tuple[dict, str]:
    """`mha2gqa ARGS` in a fresh interpreter: (its exit code and the heavy modules it imported, stderr)."""
    script = PROBE.format(args=[str(a) for a in args])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("early")
    (root / "held.txt").write_text(SAMPLE_TEXT)
    (root / "taken.json").write_text("{}\n")
    (root / "weights").mkdir()
    (root / "weights" / "config.json").write_text("{}")
    (root / "weights" / "model.bin").write_bytes(b"pickle")
    return root


MODEL = str(embedded.model_dir())
EVAL_CASES = [
    (["--data", "{root}/missing.txt"], "--data {root}/missing.txt: no such file or folder"),
    (["--reference", "{root}/no-parent"], "--reference {root}/no-parent: no such directory"),
    (["--tokenizer", "./no-tokenizer"], "--tokenizer ./no-tokenizer: no such directory"),
    (["--max-tokens", "1"], "--max-tokens 1 must be at least 2"),
    (["--context", "64", "--stride", "65"], "--stride 65 must be between 1 and --context 64"),
    (["--speed-batches", "1,0"], "--speed-batches 1,0: every value must be a positive integer"),
    (["--dtype", "int8"], "--dtype 'int8' is unknown: use auto, float32, bfloat16, float16"),
    (["--out", "{root}/taken.json"], "--out {root}/taken.json exists: pass --force to replace it"),
]


@pytest.mark.parametrize("flags, message", EVAL_CASES, ids=[c[0][0] for c in EVAL_CASES])
def test_eval_refuses_a_bad_flag_before_importing_torch(files, flags, message):
    flags = [f.format(root=files) for f in flags]
    ran, stderr = run_without_torch("eval", MODEL, "--speed", "off", *flags)
    assert ran == {"code": 2, "heavy": []}, stderr
    assert stderr.strip().splitlines() == [stderr.strip()] and message.format(root=files) in stderr, stderr


@pytest.mark.parametrize(
    "model, message",
    [("{root}/no-model", "{root}/no-model: no such directory"), ("{root}/weights", "only pickled weights")],
)
def test_eval_refuses_a_bad_model_before_importing_torch(files, model, message):
    ran, stderr = run_without_torch("eval", model.format(root=files), "--speed", "off")
    assert ran == {"code": 2, "heavy": []} and message.format(root=files) in stderr, stderr


def test_uptrain_refuses_a_missing_recipe_before_importing_torch(files):
    ran, stderr = run_without_torch("uptrain", "--recipe", files / "missing.yaml")
    assert ran == {"code": 2, "heavy": []}
    assert f"recipe {files / 'missing.yaml'}: no such file" in stderr


def test_uptrain_refuses_a_bad_recipe_key_before_importing_torch(files):
    recipe = files / "bad.yaml"
    recipe.write_text(f"model: {files}/no-model\noutput_dir: {files}/run\n")
    ran, stderr = run_without_torch("uptrain", "--recipe", recipe)
    assert ran == {"code": 2, "heavy": []} and f"recipe {recipe} has" in stderr, stderr


def test_eval_out_is_replaced_only_with_force(tmp_path):
    model = tiny_model_dir(tmp_path / "model")
    text = tmp_path / "held.txt"
    text.write_text(SAMPLE_TEXT * 4)
    out = tmp_path / "r.json"
    out.write_text('{"old": true}\n')
    refused = cli("eval", model, "--data", text, "--speed", "off", "-q", "--out", out)
    assert refused.exit_code == 2 and f"--out {out} exists: pass --force" in refused.stderr
    assert out.read_text() == '{"old": true}\n'
    replaced = cli("eval", model, "--data", text, "--speed", "off", "-q", "--out", out, "--force")
    assert replaced.exit_code == 0, replaced.output
    assert json.loads(out.read_text())["perplexity"]["tokens_scored"] > 0


OTHER_COMMANDS = [
    (
        ["convert", MODEL, "{root}/dst", "-g", "2", "--method", "calibrated", "--calibration", "{root}/missing.txt"],
        "--calibration {root}/missing.txt: no such file or folder",
    ),
    (["inspect", "{root}/no-model"], "{root}/no-model: no such directory"),
    (
        ["sweep", MODEL, "--data", "{root}/missing.txt", "--calibration", "austen", "--out", "{root}/sweep"],
        "--data {root}/missing.txt: no such file or folder",
    ),
]


@pytest.mark.parametrize("args, message", OTHER_COMMANDS, ids=[c[0][0] for c in OTHER_COMMANDS])
def test_the_other_commands_refuse_before_importing_torch_too(files, args, message):
    ran, stderr = run_without_torch(*(a.format(root=files) for a in args))
    assert ran == {"code": 2, "heavy": []} and message.format(root=files) in stderr, stderr
