"""A parent whose tokenizer gives ids at or past its vocab_size (a tokenizer of 128 tokens beside a model of 64):
the plain conversion writes DST and records the check as skipped; every path that scores SRC on token ids
(--keep-retrieval-heads, --kv-budget's layer losses, a calibrated merge, --refine) refuses in one line, exit 2,
naming the option and the id, before writing anything (corpus/tokens.py validate_ids), never a traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from tiny_models import make_tiny_tokenizer, save_tiny_model

from mha2gqa.cli import main


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "small"
    save_tiny_model(path, "llama", vocab_size=64, intermediate_size=256, num_key_value_heads=4, num_hidden_layers=2,
                    max_position_embeddings=512)  # fmt: skip
    make_tiny_tokenizer(path)  # 128 tokens
    return path


def test_the_plain_conversion_writes_and_skips_its_check(src, tmp_path):
    run = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "d"), "-g", "2", "-q"])
    assert run.exit_code == 0, run.output
    assert "check: skipped" in run.output and "outside its vocabulary of 64" in run.output
    assert (tmp_path / "d" / "config.json").exists()


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (["-g", "2", "--keep-retrieval-heads"], "--keep-retrieval-heads"),
        (["--kv-budget", "0.5"], "--calibration"),
        (["-g", "2", "--method", "calibrated"], "--calibration"),
        (["-g", "2", "--refine", "--refine-steps", "1", "--refine-global-steps", "0"], "--calibration"),
    ],
)
def test_scoring_paths_refuse_in_one_line(src, tmp_path, extra, names):
    run = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "d"), "-q", *extra])
    assert run.exit_code == 2, (run.output, run.exception)
    line = run.output.strip().splitlines()[-1]
    assert line.startswith("Error: " + names) and "outside its vocabulary of 64 tokens" in line, line
    assert "Traceback" not in run.output and not (tmp_path / "d").exists()


def test_eval_retrieval_refuses_in_one_line(src, tmp_path):
    run = CliRunner().invoke(
        main, ["eval", str(src), "--retrieval", "--speed", "off", "--out", str(tmp_path / "r.json")]
    )
    assert run.exit_code == 2, (run.output, run.exception)
    assert "vocab_size=64" in run.output.strip().splitlines()[-1]
