"""`mha2gqa report`: three result files in, report.md / report.html / report.json / PNGs out."""

import json
import re

import pytest
from click.testing import CliRunner

from mha2gqa.cli import main
from mha2gqa.errors import InputError
from mha2gqa.eval.report import write_report
from mha2gqa.eval.schema import SCHEMA

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_result(label, role, kv_heads, ppl, kv_bytes, tps, kl=None, top1=None, data_hash="abc"):
    """A schema-valid result with chosen numbers; tps: {batch: tokens/s} at context 128."""
    return {
        "schema": SCHEMA,
        "label": label,
        "role": role,
        "model": {
            "path": f"/m/{label}",
            "model_type": "llama",
            "layers": 2,
            "heads": 8,
            "kv_heads": kv_heads,
            "head_dim": 8,
            "hidden": 64,
            "params": 1000,
            "dtype": "float32",
            "provenance": None,
        },
        "reference": None,
        "data": {"source": "file", "tokens": 500, "ids_sha256": data_hash},
        "perplexity": {"perplexity": ppl, "tokens_scored": 499, "context": 64, "stride": 32},
        "agreement": None if kl is None else {"kl_mean": kl, "top1_agreement": top1, "tokens": 499},
        "kv_cache": {"formula_bytes_per_token": kv_bytes, "measured_bytes_per_token": kv_bytes, "match": True},
        "speed": {
            "grid": {},
            "points": [
                {
                    "batch": b,
                    "context": 128,
                    "new_tokens": 16,
                    "tokens_per_s": t,
                    "peak_memory_bytes": 2**20,
                    "peak_memory_kind": "cpu_rss",
                }
                for b, t in tps.items()
            ],
        },
        "attention_maps": None,
        "lm_eval": None,
        "warnings": [],
        "env": {"device": "cpu", "device_name": "x86_64", "seed": 0},
    }


@pytest.fixture
def three(tmp_path):
    results = [
        fake_result("parent", "parent", 8, 10.0, 1024, {1: 100.0, 8: 400.0}),
        fake_result("gqa2", "converted", 2, 20.0, 256, {1: 110.0, 8: 1000.0}, kl=0.5, top1=0.6),
        fake_result("gqa2-up", "uptrained", 2, 12.0, 256, {1: 105.0, 8: 1200.0}, kl=0.1, top1=0.9),
    ]
    paths = []
    for r in results:
        paths.append(tmp_path / f"{r['label']}.json")
        paths[-1].write_text(json.dumps(r))
    return paths


def test_report_writes_every_output_with_expected_rows_and_numbers(three, tmp_path):
    written = write_report(three, tmp_path / "rep")
    assert set(written) == {"markdown", "html", "json", "quality_vs_kv", "speed_vs_batch"}
    for name in ("quality_vs_kv", "speed_vs_batch"):
        assert written[name].read_bytes()[:8] == PNG_MAGIC and written[name].stat().st_size > 10_000

    table = json.loads(written["json"].read_text())
    assert table["baseline"] == "parent" and table["speed_point"] == [8, 128]
    parent, conv, up = table["rows"]
    assert [r["label"] for r in table["rows"]] == ["parent", "gqa2", "gqa2-up"]
    assert conv["perplexity_change"] == pytest.approx(1.0) and up["perplexity_change"] == pytest.approx(0.2)
    assert up["recovery"] == pytest.approx((20 - 12) / (20 - 10))  # 0.8
    assert parent["recovery"] is None and conv["recovery"] is None
    assert conv["kv_saving"] == 4.0 and up["kv_saving"] == 4.0
    assert up["speedup"] == pytest.approx(1200 / 400) and conv["speedup"] == pytest.approx(2.5)
    assert (up["kl_mean"], up["top1_agreement"]) == (0.1, 0.9)

    md = written["markdown"].read_text()
    rows = [line for line in md.splitlines() if line.startswith("| gqa2-up |")]
    assert (
        rows[0]
        == "| gqa2-up | uptrained | 2/8 | 12.00 | +20.0% | 80% | 0.1000 | 90.0% | 256 B | 4.00× | 1,200 | 3.00× |"
    )
    assert rows[1].startswith("| gqa2-up | /m/gqa2-up | 1,000 | float32 | 500 tokens")  # provenance
    assert "decode tok/s @ B=8, T=128" in md
    assert "![quality_vs_kv](quality_vs_kv.png)" in md

    page = written["html"].read_text()
    assert "<td>80%</td>" in page and "<td>1.0 KiB</td>" in page
    # Self-contained: plots inlined, nothing fetched from elsewhere.
    assert page.count("data:image/png;base64,") == 2
    assert not re.search(r"(src|href)=['\"](?!data:)", page)


def test_baseline_by_label_and_training_curve(three, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "\n".join(
            json.dumps(m)
            for m in [
                {"step": 0, "loss": None, "eval_loss": 3.0, "eval_ppl": 20.0},
                {"step": 10, "loss": 2.8},
                {"step": 20, "loss": 2.5, "eval_loss": 2.6, "eval_ppl": 13.5},
            ]
        )
        + "\n"
    )
    written = write_report(three, tmp_path / "rep", baseline="gqa2", metrics=metrics)
    assert written["training_curve"].read_bytes()[:8] == PNG_MAGIC
    rows = json.loads(written["json"].read_text())["rows"]
    assert rows[0]["kv_saving"] == 0.25 and rows[1]["perplexity_change"] == 0.0
    assert rows[2]["perplexity_change"] == pytest.approx(12 / 20 - 1)


def test_different_data_is_flagged_in_the_notes(three, tmp_path):
    other = json.loads(three[2].read_text())
    other["data"]["ids_sha256"] = "different"
    other["kv_cache"]["match"] = False
    other["warnings"] = ["KV CACHE MISMATCH: test"]
    three[2].write_text(json.dumps(other))
    md = write_report(three, tmp_path / "rep")["markdown"].read_text()
    assert "different token streams" in md
    assert "gqa2-up: KV CACHE MISMATCH: test" in md
    assert "256 B ⚠" in md


def test_bad_inputs_are_refused_before_anything_is_written(three, tmp_path):
    out = tmp_path / "rep"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "something/else"}))
    with pytest.raises(InputError, match="expected 'mha2gqa.eval/1'"):
        write_report([three[0], bad], out)
    with pytest.raises(InputError, match="--baseline 'nope'.*labels: parent, gqa2, gqa2-up"):
        write_report(three, out, baseline="nope")
    with pytest.raises(InputError, match="--metrics .*no such file"):
        write_report(three, out, metrics=tmp_path / "missing.jsonl")
    assert not out.exists()


def test_report_cli(three, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(main, ["report", *map(str, three), "--out", str(tmp_path / "rep")])
    assert ok.exit_code == 0, ok.output
    assert "report.html" in ok.output and (tmp_path / "rep" / "report.md").is_file()
    missing = runner.invoke(main, ["report", str(tmp_path / "nope.json"), "--out", str(tmp_path / "rep2")])
    assert missing.exit_code == 2
    assert "nope.json: no such result file" in missing.output
    assert not (tmp_path / "rep2").exists()
