"""CPU threads: `mha2gqa --threads N` / MHA2GQA_THREADS reach torch and child processes; demo and reproduce
(the small embedded model) use one thread on a busy machine and torch's default on an idle one, unless the
user set a count or OMP_NUM_THREADS."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from mha2gqa.cli import main
from mha2gqa.runtime import threads


@pytest.fixture
def clean_env(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "machine_busy", lambda: True)  # the one-thread case; idle: its own tests
    yield monkeypatch
    torch.set_num_threads(before)


def _threads_seen_by_demo(monkeypatch, args):
    import mha2gqa.demo

    seen = {}

    def fake_run_demo(out, **kwargs):
        import os

        seen.update(torch=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"))
        raise SystemExit(0)

    monkeypatch.setattr(mha2gqa.demo, "run_demo", fake_run_demo)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return seen


def test_demo_defaults_to_one_thread(clean_env, tmp_path):
    torch.set_num_threads(2)
    assert _threads_seen_by_demo(clean_env, ["demo", "--out", str(tmp_path / "d")]) == {"torch": 1, "omp": "1"}


def test_threads_flag_and_env_override_the_default(clean_env, tmp_path):
    assert _threads_seen_by_demo(clean_env, ["--threads", "2", "demo", "--out", str(tmp_path / "d")]) == {
        "torch": 2,
        "omp": "2",
    }
    clean_env.delenv(threads.ENV)
    clean_env.setenv(threads.ENV, "3")
    assert _threads_seen_by_demo(clean_env, ["demo", "--out", str(tmp_path / "d")])["torch"] == 3


def test_a_users_omp_num_threads_is_kept(clean_env, tmp_path):
    clean_env.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert _threads_seen_by_demo(clean_env, ["demo", "--out", str(tmp_path / "d")]) == {"torch": 2, "omp": "2"}


@pytest.mark.parametrize("value", ["0", "-1", "many", "1.5"])
def test_a_bad_thread_count_is_one_line(clean_env, value):
    result = CliRunner().invoke(main, ["--threads", value, "inspect", "nowhere"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: --threads {value!r} must be a whole number of threads, at least 1 (e.g. 1 or {__import__('os').cpu_count()})"
    ]


def test_threads_bench_smoke_times_each_count():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "bench/threads.py", "--smoke", "--threads", "1", "2"],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        line.strip("|").split("|") for line in done.stdout.splitlines() if line.startswith("| ") and "job" not in line
    ]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("1", "eval"),
        ("2", "eval"),
        ("1", "train step"),
        ("2", "train step"),
    ]
    assert all(float(r[2]) > 0 for r in rows) and rows[0][4].strip() == "1.00"


def test_small_local_models_get_one_thread_and_large_or_hub_ones_torchs_default(tmp_path, monkeypatch):
    import json

    from mha2gqa.files import embedded

    monkeypatch.setattr(threads, "machine_busy", lambda: True)

    assert threads.for_model(embedded.model_dir()) == 1  # 22 MB of safetensors
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 4096}))
    assert threads.for_model(small) == 1  # init_from_config: sized from the config
    large = tmp_path / "large"
    large.mkdir()
    (large / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000}))
    assert threads.for_model(large) is None  # ~27 GB in float32
    assert threads.for_model("meta-llama/Llama-2-7b-hf") is None and threads.for_model(None) is None


def test_eval_and_uptrain_of_a_small_model_default_to_one_thread(clean_env, tmp_path):
    import os

    import mha2gqa.eval.run
    import mha2gqa.uptrain
    from mha2gqa.files import embedded

    seen = []

    def record(*args, **kwargs):
        seen.append((torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")))
        raise SystemExit(0)

    clean_env.setattr(mha2gqa.eval.run, "evaluate", record)
    clean_env.setattr(mha2gqa.uptrain, "train", record)
    torch.set_num_threads(2)
    result = CliRunner().invoke(main, ["eval", str(embedded.model_dir()), "--data", str(embedded.heldout_path())])
    assert result.exit_code == 0, result.output
    torch.set_num_threads(2)
    clean_env.delenv("OMP_NUM_THREADS")
    from mha2gqa.demo import DEMO_RECIPE

    recipe = str(DEMO_RECIPE)
    overrides = [f"model={embedded.model_dir()}", f"output_dir={tmp_path / 'up'}"]
    overrides += [
        f"data.train={json_list(embedded.train_paths())}",
        f"data.eval={json_list([embedded.heldout_path()])}",
    ]
    result = CliRunner().invoke(main, ["uptrain", "--recipe", recipe, *overrides])
    assert result.exit_code == 0, result.output
    assert seen == [(1, "1"), (1, "1")]


def json_list(paths) -> str:
    import json

    return json.dumps([str(p) for p in paths])


@pytest.mark.parametrize(
    "load,cores,busy", [(0.9, 2, False), (1.49, 2, False), (1.5, 2, True), (17.0, 2, True), (6.0, 8, False)]
)
def test_the_machine_is_busy_when_other_processes_occupy_every_core(monkeypatch, load, cores, busy):
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: cores)
    assert threads.machine_busy() is busy


def test_on_an_idle_machine_demo_and_small_models_keep_torchs_default(clean_env, tmp_path):
    from mha2gqa.files import embedded

    clean_env.setattr(threads, "machine_busy", lambda: False)
    torch.set_num_threads(2)
    assert _threads_seen_by_demo(clean_env, ["demo", "--out", str(tmp_path / "d")]) == {"torch": 2, "omp": None}
    assert threads.for_model(embedded.model_dir()) is None


def test_a_hostile_config_sizes_as_unknown_not_a_traceback(tmp_path):
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 5000 + "]" * 5000)  # the stdlib decoder recurses past the limit
    assert threads.for_model(deep) is None
