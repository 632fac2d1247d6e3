"""The measurement registry (eval/measurements.py) and the report's metrics (eval/metrics.py): a new number
is one Measurement plus one Metric, as docs/eval.md's worked example shows; every check runs before a
model is loaded."""

import json

import pytest
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_model

from mha2gqa.eval import evaluate, measurements, metrics
from mha2gqa.eval.options import EvalOptions
from mha2gqa.report import write_report
from mha2gqa.runtime.errors import InputError

QUICK = dict(context=32, stride=16, speed_preset="off", progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    save_tiny_model(root / "model", "llama", num_key_value_heads=2, seed=1)
    make_tiny_tokenizer().save_pretrained(root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 2)
    return root


def test_a_new_metric_is_one_measurement_and_one_metric(tiny, tmp_path, monkeypatch):
    """docs/eval.md's worked example, verbatim in spirit: the vocabulary size, measured and reported."""

    def validate_vocab(o):
        if o.label == "no-vocab":
            raise InputError("--label no-vocab: refused by the vocab measurement's check")

    def measure_vocab(run):
        return {"vocab": {"size": run.model.config.vocab_size}}

    monkeypatch.setattr(
        measurements,
        "MEASUREMENTS",
        [*measurements.MEASUREMENTS, measurements.Measurement("vocab", validate_vocab, measure_vocab)],
    )
    entry = metrics.Metric("vocab_size", "vocab", "the model's vocabulary size", "vocab.size", fmt=lambda v: f"{v:,}")
    monkeypatch.setattr(metrics, "METRICS", [*metrics.METRICS, entry])
    monkeypatch.setitem(metrics.BY_NAME, "vocab_size", entry)

    result = evaluate(tiny / "model", str(tiny / "text.txt"), out=tmp_path / "r.json", **QUICK)
    assert result["vocab"] == {"size": json.loads((tiny / "model" / "config.json").read_text())["vocab_size"]}
    written = write_report([tmp_path / "r.json"], tmp_path / "report")
    lines = written["markdown"].read_text().splitlines()
    header = next(line for line in lines if line.startswith("| model"))
    assert header.endswith("| vocab |") and lines[lines.index(header) + 2].endswith(f"| {result['vocab']['size']:,} |")
    row = json.loads(written["json"].read_text())["rows"][0]
    assert row["vocab_size"] == result["vocab"]["size"]
    # a model card beside the result shows it, and a sweep measures it for each candidate and shows its
    # column, with no change to the card or the sweep
    from mha2gqa.eval.card_table import measured_cells
    from mha2gqa.report import sweep_pages
    from mha2gqa.sweep import candidates

    (tmp_path / "r.json").rename(tmp_path / "report" / "eval.json")
    assert ("vocab", f"{result['vocab']['size']:,}") in measured_cells(tmp_path / "report")["eval.json"]

    swept = candidates.metric_values(result, result)
    assert swept["vocab_size"] == result["vocab"]["size"]
    (vocab,) = [cell for header, cell in sweep_pages.metric_columns([swept]) if header == "vocab"]
    assert vocab(swept, ()) == f"{result['vocab']['size']:,}"
    with pytest.raises(InputError, match="refused by the vocab measurement"):
        evaluate(tiny / "missing-model", str(tiny / "text.txt"), label="no-vocab", **QUICK)  # before any loading


def test_each_measurement_checks_its_own_flags_before_loading(tiny):
    """A missing model folder would fail at loading: every refusal here comes first, from its measurement."""
    cases = [
        (dict(kv_batch=0), "--kv-batch 0 must be at least 1"),
        (dict(batch_size=0, data="x"), "--batch-size 0 must be at least 1"),
        (dict(reference="p", data=None), "--reference needs --data"),
        (dict(attention_text="hi"), "--attention-maps needs --out"),
        (dict(lm_eval_limit=0), "--lm-eval-limit 0 must be at least 1"),
        (dict(speed_preset="cpu", speed_batches=(0,)), "--speed-batches 0: every value must be a positive integer"),
        (dict(role="boss"), "--role 'boss' is not a role"),
    ]
    for fields, message in cases:
        with pytest.raises(InputError, match=message.replace("(", r"\(")):
            measurements.validate_all(EvalOptions(**fields))
    assert [m.key for m in measurements.MEASUREMENTS] == [
        "quality",
        "retrieval",
        "kv_cache",
        "speed",
        "attention_maps",
        "lm_eval",
    ]
