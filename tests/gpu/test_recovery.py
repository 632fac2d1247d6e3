"""Part 6 of bench/gpu_check.py: the real model's recovery at a GPU budget (issue 36, item 4). bench/recovery_real.py
with `--recipe distill-parent-gpu` (every parameter, bf16, 65,536 tokens a step; its lr held constant so that the
checkpoint at each stop is what a shorter run reaches), from the mean-pooled and the calibrated + --refine start,
each point's perplexity ratio to the parent on the four probe domains: how many distillation tokens close the gap.

The parent is RECOVERY_PARENT, a model folder on the GPU machine (SmolLM2-135M-Instruct is the one measured on CPU:
scripts/gpu_smollm2.py brings it there in pieces and builds it); where it is unset, the embedded model (8 -> 1 kv
heads), and the skipped list says so. The bench runs in a process of its own, ended before the part's time limit
(GPU_CHECK_LIMIT_S): the starts it finished by then are kept. Smoke: bench's --smoke sizes on CPU."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_common import MARKS, ROOT, embedded, needs

pytestmark = MARKS

STEPS = "2,4,16"  # of 65,536 tokens: 131,072, 262,144 and 1,048,576 tokens (the CPU run's last point is 102,400)
# 512 sequences of 2,048, 256 at once of each kind (random starts, then chat turns): one forward a token through the
# KV cache, so a wide batch is what keeps it cheap; corpus/sampling.py ranks and draws on the GPU (2026-12-04: before,
# the CPU drew every token and SmolLM2's 1.05M took over 8 min, docs/benchmarks.md#gpu-check-benchgpu_checkpy).
SAMPLING = '{"batch": 512}'
MARGIN_S = 30  # of the part's limit, left to pytest to write what the bench finished


def command(part, parent: str, out) -> list[str]:
    bench = [sys.executable, str(ROOT / "bench" / "recovery_real.py")]
    paths = ["--work", str(part.work / "work"), "--out", str(out), "--plot", str(part.work / "recovery.png")]
    if part.smoke:
        return [*bench, "--smoke", "--steps", "2", *paths]  # one leg a start: its stop and resume are bench's test
    sized = ["--recipe", "distill-parent-gpu", "--steps", STEPS, "--sampling", SAMPLING, "--convert-args=--no-check"]
    sized += ["--set", "optim.schedule=constant"]
    if parent == str(embedded.MODEL_DIR):  # its positions end at 512: 128 blocks of 512 keep 65,536 tokens a step
        sized += ["seq_len=512", "micro_batch_size=32"]
    return [*bench, parent, *sized, *paths]


def test_recovery(part):
    needs("matplotlib")
    parent = os.environ.get("RECOVERY_PARENT") or str(embedded.MODEL_DIR)
    if not os.environ.get("RECOVERY_PARENT"):
        part.skip("the real model", "RECOVERY_PARENT unset: the embedded model measured instead (docs/uptrain.md)")
    out = part.work / "recovery.json"
    limit = int(os.environ.get("GPU_CHECK_LIMIT_S") or 300) - MARGIN_S
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(command(part, parent, out), env=env, timeout=limit, cwd=ROOT)
        finished = done.returncode == 0
    except subprocess.TimeoutExpired:
        finished = False
    found = json.loads(out.read_text()) if out.is_file() else {"starts": {}}
    if os.environ.get("OUT") and not part.smoke:  # the device tool brings $OUT back: the whole record and its plot
        for made in (out, part.work / "recovery.png"):
            if made.is_file():
                shutil.copy(made, Path(os.environ["OUT"]) / made.name)
    part.result = result = {
        "parent": parent,
        "finished": finished,
        "recipe": found.get("recipe"),
        "parent_perplexity": found.get("parent"),
        "starts": {name: summary(entry) for name, entry in found.get("starts", {}).items()},
    }
    assert result["starts"], f"no start finished within {limit} s"
    for name, entry in result["starts"].items():
        gm = [p["geometric_mean"] for p in entry["points"]]
        assert all(math.isfinite(r) and r > 0 for r in gm), (name, gm)
    # the mean-pooled start is far from its parent (1,141x on SmolLM2): distillation must bring it closer. A close
    # start may move either way on toy sizes, so its numbers are reported, not bounded.
    gm = [p["geometric_mean"] for p in result["starts"]["mean"]["points"]]
    assert gm[-1] < gm[0], f"mean: distillation did not bring the model closer to its parent: {gm}"
    assert finished, f"the bench stopped before both starts were measured (limit {limit} s)"


def summary(entry: dict) -> dict:
    """A start's points (tokens, ratio per domain, geometric mean), how much of the gap closed, and the times."""
    points = [{k: p[k] for k in ("tokens", "ratio", "geometric_mean")} for p in entry["points"]]
    legs = entry.get("distill", [])
    return {
        "points": points,
        "closing": entry.get("closing"),
        "convert_s": (entry.get("convert") or {}).get("wall_s"),
        "distill_s": round(sum(leg["wall_s"] for leg in legs), 1),
    }
