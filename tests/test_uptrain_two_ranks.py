"""Two CPU ranks through the real launcher: world size 2, disjoint data, identical replicas, one
final checkpoint.

`accelerate launch --cpu --num_processes 2` silently starts ONE process; the command below starts
two gloo ranks (docs/uptrain.md), and the test checks that it did.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from uptrain_helpers import corpus, metrics, recipe_file, tiny_model_dir

from mha2gqa.records.provenance import latest

LAUNCH = [
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    return subprocess.run(
        [sys.executable, *LAUNCH, "--main_process_port", str(_free_port()), "-m", "mha2gqa.uptrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _trace(out, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / "trace" / f"rank{rank}.jsonl").read_text().splitlines()]


def test_two_cpu_ranks_train_one_model_on_disjoint_data(tmp_path):
    model = tiny_model_dir(tmp_path / "model")
    recipe = recipe_file(
        tmp_path / "r.yaml",
        model=str(model),
        output_dir=str(tmp_path / "out"),
        data={"train": str(corpus(tmp_path / "c.jsonl"))},
        grad_accum=2,
        save_every=2,
        eval_every=2,
        keep_last=5,
    )
    result = _launch(["--recipe", str(recipe), "trace_samples=true", "budget.max_steps=4"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert result.stdout.count("output: ") == 1  # printed by rank 0 only

    provenance = latest(out, "uptrain")
    assert provenance["world_size"] == 2
    assert provenance["tokens_seen"] == 4 * 2 * 4 * 2 * 32  # steps x accum x batch x ranks x seq_len

    traces = [_trace(out, rank) for rank in (0, 1)]
    blocks = [[h for rec in t if "blocks" in rec for h in rec["blocks"]] for t in traces]
    assert len(blocks[0]) == len(blocks[1]) == 4 * 2 * 4  # every micro-batch of every step
    assert set(blocks[0]).isdisjoint(blocks[1])  # the ranks never saw the same block
    sums = [t[-1]["final_param_sums"] for t in traces]
    assert sums[0].keys() == sums[1].keys()
    for name in sums[0]:  # DDP kept the replicas identical
        assert sums[0][name] == pytest.approx(sums[1][name], rel=1e-6, abs=1e-6), name

    # one final checkpoint, two resumable ones, and every rank's RNG state in each
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step-00000002", "step-00000004"]
    assert (out / "checkpoints" / "step-00000004" / "random_states_1.pkl").is_file()
    lines = metrics(out)
    assert [ln["step"] for ln in lines] == [0, 2, 4] and all("eval_ppl" in ln for ln in lines)
    assert lines[-1]["tokens"] == provenance["tokens_seen"]
