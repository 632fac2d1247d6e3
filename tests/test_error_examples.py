"""Every example an error gives for a flag ("e.g. X") is a value that flag accepts: each refusal below is
triggered, its example read out of the message, and the same command run again with the example in place of the
bad value; the flag is then not refused (the command may stop later for another reason, never naming it)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from tiny_models import make_tiny_tokenizer, save_tiny_model

from mha2gqa.cli import main


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("examples") / "llama"
    save_tiny_model(path, "llama", max_position_embeddings=512)  # long enough for the probe's 128 and 512
    make_tiny_tokenizer(path)
    return path


EVAL = ["--max-tokens", "64", "--speed", "off"]
# (command and its other arguments, SRC standing for the model; the flag; a value it refuses with an example)
CASES = [
    (["eval", "SRC", *EVAL, "--retrieval"], "--retrieval-depths", ""),
    (["eval", "SRC", *EVAL, "--retrieval"], "--retrieval-depths", "2"),
    (["eval", "SRC", *EVAL, "--retrieval"], "--retrieval-depths", "x"),
    (["eval", "SRC", *EVAL, "--retrieval"], "--retrieval-lengths", ""),
    (["eval", "SRC", *EVAL, "--retrieval"], "--retrieval-lengths", "5"),
    (["eval", "SRC", *EVAL, "--retrieval"], "--retrieval-lengths", "x"),
    (
        ["eval", "SRC", "--max-tokens", "64", "--speed", "cpu", "--new-tokens", "2", "--repeats", "1"],
        "--speed-batches",
        "x",
    ),
    (
        ["eval", "SRC", "--max-tokens", "64", "--speed", "cpu", "--new-tokens", "2", "--repeats", "1"],
        "--speed-contexts",
        "x",
    ),
    (["convert", "SRC", "DST", "-g", "2", "--dry-run"], "--max-shard-size", "lots"),
    (["convert", "SRC", "DST", "-g", "2", "--dry-run", "--refine"], "--refine-steps", "-1"),
    (["convert", "SRC", "DST", "-g", "2", "--dry-run", "--refine"], "--refine-tokens", "0"),
    (["convert", "SRC", "DST", "-g", "2", "--dry-run", "--refine"], "--refine-batch-blocks", "0"),
    (["convert", "SRC", "DST", "-g", "2", "--dry-run", "--refine"], "--refine-global-steps", "-1"),
    (["convert", "SRC", "DST", "-g", "2", "--dry-run", "--refine"], "--refine-memory", "lots"),
    (["convert", "SRC", "DST", "-g", "2", "--dry-run", "--refine"], "--refine-lr", "nan"),
    (["convert", "SRC", "DST", "-g", "2", "--dry-run", "--refine"], "--refine-global-lr", "-1"),
    (["convert", "SRC", "DST", "-g", "2", "--dry-run", "--refine"], "--refine-opening-weight", "-1"),
    (["sweep", "SRC", "--out", "OUT", "--dry-run"], "--groups", "x"),
    (["sweep", "SRC", "--out", "OUT", "--dry-run"], "--groups", ","),
    (["sweep", "SRC", "--out", "OUT", "--dry-run"], "--groups", "0"),
    (["sweep", "SRC", "--out", "OUT", "--dry-run"], "--methods", ","),
    (["sweep", "SRC", "--out", "OUT", "--dry-run"], "--calibration-tokens", "0"),
    (["reproduce", "--out", "OUT", "--dry-run"], "--kv-heads", "x"),
    (["reproduce", "--out", "OUT", "--dry-run"], "--alphas", "x"),
    (["reproduce", "--out", "OUT", "--dry-run"], "--methods", "bogus"),
    (["demo", "--out", "OUT", "--dry-run"], "--alpha", "2"),
    (["serve-bench", "SRC", "CHILD"], "--capacity-concurrency", "x"),
    (["serve-bench", "SRC", "CHILD"], "--concurrency", "x"),
    (["serve-bench", "SRC", "CHILD"], "--startup-timeout", "0"),
]


def example_of(message: str, flag: str) -> str:
    """The value after the message's first "e.g." (past the flag when the example repeats it)."""
    found = re.search(r"e\.g\. (?:" + re.escape(flag) + r" )?([^\s)]+)", message)
    assert found, f"no example in {message!r}"
    return found.group(1).rstrip(".,;:")


def _run(words: list[str], src, tmp_path):
    swap = {"SRC": str(src), "DST": str(tmp_path / "dst"), "OUT": str(tmp_path / "out"), "CHILD": str(tmp_path / "c")}
    return CliRunner().invoke(main, [swap.get(w, w) for w in words])


@pytest.mark.parametrize(("words", "flag", "bad"), CASES, ids=[f"{c[1]} {c[2]!r}" for c in CASES])
def test_an_errors_example_is_a_value_its_flag_accepts(words, flag, bad, src, tmp_path):
    refused = _run([*words, flag, bad], src, tmp_path)
    assert refused.exit_code == 2 and flag in refused.output or "Invalid value" in refused.output, refused.output
    example = example_of(refused.output, flag)
    again = _run([*words, flag, example], src, tmp_path)
    lines = again.output.strip().splitlines()
    if again.exit_code != 0:  # another reason is allowed (no vLLM here), never this flag
        assert flag not in lines[-1] and "Invalid value" not in again.output, (example, lines[-1])
