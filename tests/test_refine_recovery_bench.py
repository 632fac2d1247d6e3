"""bench/refine_recovery.py --smoke: the recovery-curve script runs end to end and writes its JSON and plot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "refine_recovery.py"


@pytest.mark.slow  # 25 s at load 1 (2 cores): a --refine conversion and four 1-2 step uptraining runs
def test_recovery_smoke(tmp_path):
    out, png = tmp_path / "recovery.json", tmp_path / "recovery.png"
    subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(out), "--plot", str(png)],
        check=True,
        timeout=900,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert [row["start"] for row in result["rows"]] == ["mean", "calibrated+refine"]
    for row in result["rows"]:
        assert [p["alpha"] for p in row["points"]] == [0.0, 0.05, 0.1]
        assert [p["tokens"] for p in row["points"]] == [0, 1024, 2048]  # one and two steps of 2 x 512 tokens
        assert all(p["perplexity"] > 1 for p in row["points"])
    mean, refined = result["rows"]
    assert refined["points"][0]["perplexity"] < mean["points"][0]["perplexity"]  # refine starts closer to the parent
    assert {check["start"] for check in result["targets"]} == set()  # no alpha 0.005 in the smoke run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
