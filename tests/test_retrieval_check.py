"""The retrieval probe where a conversion is judged: convert's check (--check-retrieval) and sweep (--retrieval),
each with eval's questions and numbers (scoring/retrieval*.py)."""

import json

from click.testing import CliRunner
from fault_helpers import sweep_args
from tiny_models import save_tiny_inputs

from mha2gqa.cli import main as cli
from mha2gqa.eval import evaluate


def _tiny(root):
    return save_tiny_inputs(root, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4)


def test_the_check_runs_evals_probe_when_asked_and_records_recall_per_length(tmp_path):
    root = _tiny(tmp_path)
    run = CliRunner().invoke(cli, ["convert", str(root / "src"), str(root / "d"), "-g", "2", "--check-retrieval", "-q"])
    assert run.exit_code == 0, run.output
    check = json.loads((root / "d" / "mha2gqa.json").read_text())["lineage"][-1]["check"]
    found = check["retrieval"]
    assert [x["length"] for x in found["lengths"]] == [128, 256]  # the defaults within max_position_embeddings=256
    assert found["items"] == 24 and found["seed"] == 0 and "reference_recall" in found
    assert "retrieval probe: recall " in run.output and "256 tokens" in run.output
    assert "Retrieval probe: recall" in (root / "d" / "README.md").read_text()
    # eval's own probe on the same pair gives the same numbers
    result = evaluate(root / "d", None, reference=root / "src", retrieval=True, speed_preset="off", progress=False)
    for key in ("recall", "reference_recall", "answer_probability_kept", "items"):
        assert result["retrieval"][key] == found[key], key
    plain = CliRunner().invoke(cli, ["convert", str(root / "src"), str(root / "p"), "-g", "2", "-q"])
    assert (
        plain.exit_code == 0
        and "retrieval" not in json.loads((root / "p" / "mha2gqa.json").read_text())["lineage"][-1]["check"]
    )


def test_check_retrieval_without_the_check_is_refused(tmp_path):
    root = _tiny(tmp_path)
    args = ["convert", str(root / "src"), str(root / "d"), "-g", "2", "--check-retrieval", "--no-check"]
    run = CliRunner().invoke(cli, args)
    assert run.exit_code == 2 and "--check-retrieval is part of the check, and --no-check turns it off" in run.output
    assert not (root / "d").exists()


def test_sweep_with_retrieval_has_the_recall_column_and_each_rows_probe(tmp_path):
    root = _tiny(tmp_path)
    out = root / "s"
    args = [str(a) for a in sweep_args(root, out, "--methods", "mean", "--groups", "2", "--retrieval", "-q")]
    run = CliRunner().invoke(cli, args)
    assert run.exit_code == 0, (run.output, run.exception)
    record = json.loads((out / "sweep.json").read_text())
    assert record["settings"]["retrieval"] is True
    row = record["candidates"][0]
    assert 0.0 <= row["retrieval_recall"] <= 1.0 and row["retrieval_kept"] > 0
    assert [x["length"] for x in row["result"]["retrieval"]["lengths"]] == [128, 256]
    assert "retrieval recall" in (out / "sweep.md").read_text()
    again = CliRunner().invoke(
        cli, [str(a) for a in sweep_args(root, root / "s2", "--methods", "mean", "--groups", "2", "-q")]
    )
    assert again.exit_code == 0, again.output
    assert "retrieval_recall" not in json.loads((root / "s2" / "sweep.json").read_text())["candidates"][0]
