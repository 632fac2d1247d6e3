"""bench/gpu_check.py, the one command a lent GPU runs, at its --smoke size on CPU: every part (a module of
tests/gpu) runs in its own pytest process, what needs CUDA is skipped with the reason, a failing part is recorded
with its traceback and the later parts still run; without --smoke and without CUDA the gpu tests skip, as in the
default suite. (The GPU numbers are still owed.)"""

import json
import math
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --smoke run with part 2 made to fail (its own code has test_bench_smoke.py's test)."""
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--smoke", "--out", str(out), "--fail", "uptrain_gpu"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1500,
    )
    record = json.loads((out / "gpu_check.json").read_text())
    return done, record, out


def test_every_part_runs_in_order_and_the_failing_one_is_recorded(smoke):
    done, record, out = smoke
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]  # one part failed
    parts = {p["name"]: p for p in record["parts"]}
    assert list(parts) == ["eval_gpu", "uptrain_gpu", "convert_refine", "fsdp", "qlora", "recovery", "decode_paths"]
    assert [p["status"] for p in record["parts"]] == ["ok", "failed", "ok", "ok", "ok", "ok", "ok"], record["parts"]
    failed = parts["uptrain_gpu"]
    assert failed["error"] == "RuntimeError: deliberate failure of part uptrain_gpu (--fail uptrain_gpu)"
    assert failed["traceback"].startswith("Traceback (most recent call last)")
    assert "RuntimeError: deliberate failure" in failed["traceback"] and failed["result"] is None
    for part in record["parts"]:
        assert part["estimate_s"] > 0 and part["limit_s"] == 300 and finite(part["seconds"]) and finite(part["cpu_s"])
    # the estimate of each part is printed before it starts, in order
    starts = [done.stdout.index(f"[{i}] {name}:") for i, name in enumerate(parts, 1)]
    assert starts == sorted(starts)
    assert re.search(r"\[3\] convert_refine: .* \(estimate \d+ s, limit 300 s\)", done.stdout)
    assert record["smoke"] is True and record["budget_s"] is None and record["machine"]["gpu"] is None
    table = (out / "gpu_check.md").read_text()
    assert "| uptrain_gpu | status | failed |" in table and "| fsdp | status | ok |" in table
    assert re.search(r"^\| qlora \| part\.seconds \| [\d.]+ \|$", table, re.MULTILINE)
    assert "| convert_refine | stages.calibration.seconds |" in table
    assert "==== qlora:" in (out / "gpu_check.log").read_text()


def test_what_needs_cuda_is_skipped_with_the_reason(smoke):
    _, record, _ = smoke
    skipped = {p["name"]: {s["what"]: s["reason"] for s in p["skipped"]} for p in record["parts"]}
    assert skipped["eval_gpu"] == {"CUDA graphs": "need CUDA: on CPU the graph rows time a plain StaticCache decode"}
    assert skipped["convert_refine"] == {"CUDA vs CPU refined weights": "needs CUDA"}
    assert (
        list(skipped["qlora"]) == ["load_in_4bit (QLoRA)"]
        and "bitsandbytes" in skipped["qlora"]["load_in_4bit (QLoRA)"]
    )
    assert skipped["fsdp"] == {}
    assert (
        list(skipped["recovery"]) == ["the real model"]
        and "RECOVERY_PARENT unset" in skipped["recovery"]["the real model"]
    )
    assert skipped["decode_paths"] == {
        f"{base}/{backend}": f"the {backend} SDPA backend needs CUDA"
        for base in ("dynamic", "grouped")
        for backend in ("efficient", "cudnn")
    }


def test_eval_part_measures_mha_gqa_and_mqa(smoke):
    _, record, out = smoke
    result = next(p for p in record["parts"] if p["name"] == "eval_gpu")["result"]
    assert result["preset"] == "cpu-tiny"
    assert [v["kv_heads"] for v in result["variants"]] == [8, 2, 1]
    mha, gqa, mqa = (v["kv_cache"] for v in result["variants"])
    assert mha["match"] and gqa["match"] and mqa["match"]
    assert mha["measured_bytes_per_token"] == 4 * gqa["measured_bytes_per_token"] == 8 * mqa["measured_bytes_per_token"]
    for variant in result["variants"]:
        assert [p["batch"] for p in variant["points"]] == [1, 2]
        for point in variant["points"]:
            assert point["eager"]["tokens_per_s"] > 0
            assert point["graph"].get("tokens_per_s", 0) > 0 and point["graph"]["cuda_graph"] is False
    assert set(result["ratio_at_largest_batch"]) == {"eager", "graph"}
    log = (out / "gpu_check.log").read_text()
    assert len(re.findall(r"^\| [12] \| ", log, re.MULTILINE)) == 2  # eval_gpu's table: one row per batch


def test_convert_part_times_each_stage(smoke):
    _, record, _ = smoke
    result = next(p for p in record["parts"] if p["name"] == "convert_refine")["result"]
    assert result["kv_heads"] == "8 -> 2" and result["calibration_tokens"] == 2048 and result["refine_device"] == "cpu"
    stages = result["stages"]
    assert list(stages) == ["calibration", "merge", "merge+refine", "refine"]
    for stage in stages.values():
        assert stage["seconds"] > 0 and stage["peak_memory_bytes"] > 0
    assert stages["refine"]["seconds"] <= stages["merge+refine"]["seconds"]
    assert result["user_total_s"] == pytest.approx(stages["calibration"]["seconds"] + stages["merge+refine"]["seconds"])
    assert 0 < result["heldout_error_after_mean"] <= result["heldout_error_before_mean"]  # refine keeps only gains


def test_fsdp_part_checks_the_final_checkpoint_and_the_resume(smoke):
    _, record, _ = smoke
    result = next(p for p in record["parts"] if p["name"] == "fsdp")["result"]
    assert result["checkpoint_format"] == "safetensors"  # on CPU accelerate runs the FSDP config without FSDP
    assert not any(result["loading_problems"].values())
    assert result["final_vs_trained"]["equal"] and result["final_vs_trained"]["tensors"] > 0
    assert not result["final_vs_step1"]["equal"] and result["final_vs_step1"]["max_abs_diff"] > 0
    assert result["resumed_vs_uninterrupted"]["equal"]  # exact on CPU
    losses = result["loss_steps_4_5"]
    assert losses["resumed"] == losses["uninterrupted"] and all(finite(x) for x in losses["resumed"])


def test_qlora_part_merges_into_a_plain_checkpoint(smoke):
    _, record, _ = smoke
    result = next(p for p in record["parts"] if p["name"] == "qlora")["result"]
    assert not any(result["loading_problems"].values()) and result["all_finite"]
    assert result["quantization_config_left"] is False and result["saved_dtype"] == "float32"
    assert result["changed_tensors"] == 6 * 4 and result["changed_outside_attention"] == []  # q, k, v, o of 6 layers
    assert result["adapter"]["method"] == "lora" and result["adapter"]["merged"] is True
    assert finite(result["final_eval_loss"])


def test_recovery_part_scores_both_starts_at_every_point(smoke):
    """Part 6 runs bench/recovery_real.py (at its --smoke size here) and keeps its points."""
    _, record, out = smoke
    entry = next(p for p in record["parts"] if p["name"] == "recovery")
    result = entry["result"]
    assert result["finished"] and result["recipe"] == "distill-parent-cpu"  # --smoke: bench's own smoke sizes
    assert result["parent"].endswith("austen-mha") and list(result["starts"]) == ["mean", "calibrated"]
    assert list(result["parent_perplexity"]) == ["prose", "code", "python_docs", "licences"]
    for start in result["starts"].values():
        assert [p["tokens"] for p in start["points"]] == [0, 256]
        assert all(finite(p["geometric_mean"]) for p in start["points"]) and finite(start["closing"]["gap_closed"])
        assert finite(start["distill_s"]) and start["distill_s"] > 0
    assert 0 < result["starts"]["mean"]["closing"]["gap_closed"] < 1  # 2 steps close a little of the mean's gap
    assert "| recovery | starts.mean.points[1].geometric_mean |" in (out / "gpu_check.md").read_text()


def test_decode_paths_part_times_every_path_cpu_has_and_profiles_a_step(smoke):
    """Part 7 (bench/decode_paths_gpu.py) at toy sizes: every path that exists on CPU ran (forced flash and math, FORCE_GQA where the installed
    transformers reads it, FlexAttention and torch.compile included), each model's tokens/s recorded; the profile of
    one step names the ops it spent its time in; the best path per model and GQA-8's ratio to MHA are kept."""
    _, record, out = smoke
    result = next(p for p in record["parts"] if p["name"] == "decode_paths")["result"]
    ran = {"dynamic", "grouped", "static", "static+force_gqa", "flex", "static-compiled"}
    ran |= {f"{base}/{b}" for base in ("dynamic", "grouped") for b in ("flash", "math")}
    assert set(result["paths"]) == ran and result["force_gqa_in_transformers"] is True
    for name, found in result["paths"].items():
        assert "error" not in found, (name, found)
        assert list(found["rows"]) == ["MHA", "GQA-8", "MQA"] and found["rows"]["MHA"]["vs_mha"] == 1.0
        assert all(finite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in found["rows"].values())
    assert "torch.compile" in result["paths"]["static-compiled"]["path"]
    assert "TRANSFORMERS_SDPA_FORCE_GQA=1" in result["paths"]["static+force_gqa"]["path"]
    assert result["sdpa_priority"][:3] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    for path in ("dynamic", "grouped"):
        top = result["profile"][path]["GQA-8"]["top"]
        assert top[0]["self_us"] >= top[-1]["self_us"] > 0 and any(t["name"] == "aten::mm" for t in top)
    best = result["best"]
    assert best["per_model"]["MHA"]["path"] in ran and finite(best["gqa8_over_mha"])
    assert best["goal_2x_met"] == (best["gqa8_over_mha"] >= 2)
    assert "| decode_paths | best.gqa8_over_mha |" in (out / "gpu_check.md").read_text()


def test_a_part_past_its_limit_is_ended(tmp_path):
    # No bound on the wall time (a busy machine stretches it): code None says it was ended, as a run to
    # the end would have returned 0. The limit leaves a loaded machine time to start Python and print.
    with (tmp_path / "log").open("w") as log:
        code, output = gpu_check.run_logged(
            [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"], None, 10, log, "sleep"
        )
    assert code is None and "started" in output


def test_limits_leave_room_for_the_later_parts():
    eval_part, *later = gpu_check.select_parts(gpu_check.CALLS[0])
    reserve = sum(p.estimate_s for p in later)
    budget = gpu_check.BUDGET_S
    assert gpu_check.part_limit(eval_part, False, budget, reserve) == min(eval_part.limit_s, budget - reserve)
    assert gpu_check.part_limit(eval_part, False, 100, reserve) == eval_part.estimate_s  # not below its estimate
    assert gpu_check.part_limit(eval_part, False, 30, reserve) == 30  # nor past the budget's end
    assert gpu_check.part_limit(eval_part, True, None, reserve) == 300
    # the two device calls a lent session makes hold every part once, recovery (which takes what is left) last,
    # and each fits one call's budget
    calls = [gpu_check.select_parts(call) for call in gpu_check.CALLS]
    assert sorted(p.name for call in calls for p in call) == sorted(p.name for p in gpu_check.PARTS)
    assert len([p for call in calls for p in call]) == len(gpu_check.PARTS) and calls[-1][-1].name == "recovery"
    assert all(sum(p.estimate_s for p in call) < gpu_check.BUDGET_S for call in calls)


def test_bad_parts_are_one_error_line(capsys):
    assert gpu_check.main(["--smoke", "--parts", "2,sixth"]) == 2
    assert (
        capsys.readouterr().err
        == "Error: --parts 2,sixth: 'sixth' is not a part (1-7 or eval_gpu, uptrain_gpu, convert_refine, fsdp, qlora, "
        "recovery, decode_paths)\n"
    )


def fake_wheel(folder: Path, name: str, version: str, module: str = "") -> Path:
    """A minimal pure-Python wheel (what pip needs: WHEEL, METADATA, RECORD)."""
    info = f"{name}-{version}.dist-info"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{name}/__init__.py", module)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/WHEEL,,\n{info}/METADATA,,\n{info}/RECORD,,\n")
    return wheel


def test_carried_wheels_are_installed_for_the_parts(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    fake_wheel(folder, "gpucheckprobe", "1.0", "VALUE = 42\n")
    fake_wheel(folder, "pytest", pytest.__version__)  # installed at that version already: left alone
    site, installed = gpu_check.install_wheels(tmp_path, folder)
    assert site == tmp_path / "site" and installed == ["gpucheckprobe-1.0-py3-none-any.whl"]
    env = gpu_check.child_env(site, tmp_path)
    assert env["PYTHONPATH"].split(":")[:2] == [str(site), str(ROOT)] and env["HF_HUB_OFFLINE"] == "1"
    done = subprocess.run(
        [sys.executable, "-c", "import gpucheckprobe, mha2gqa; print(gpucheckprobe.VALUE, mha2gqa.__file__)"],
        env=env, capture_output=True, text=True, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert done.stdout.split() == ["42", str(ROOT / "mha2gqa" / "__init__.py")]
    assert gpu_check.install_wheels(tmp_path, tmp_path / "none") == (None, [])


def test_the_gpu_tests_skip_without_cuda_and_each_part_is_a_module():
    """What the default suite does with tests/gpu on a machine without a GPU: every test is marked `gpu` (a
    registered marker: --strict-markers) and skips, saying how it is run; and one module per part of the list."""
    assert sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")) == sorted(
        f"test_{part.name}.py" for part in gpu_check.PARTS
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")} | {"CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-m", "gpu", "--strict-markers", "-p", "no:cacheprovider"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"^7 skipped", done.stdout.splitlines()[-1]), done.stdout[-2000:]
    assert done.stdout.count("needs a CUDA GPU: `python3 bench/gpu_check.py` runs it there") == 7


def test_a_part_without_cuda_outside_smoke_is_recorded_as_not_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")} | {"CUDA_VISIBLE_DEVICES": ""}
    with (tmp_path / "log").open("w") as log:
        entry = gpu_check.run_part(gpu_check.PARTS[0], gpu_check.argparse.Namespace(smoke=False, fail=None, budget=480),
                                   env, tmp_path / "work", log, 480, 0)  # fmt: skip
    assert entry["status"] == "failed" and entry["result"] is None
    assert (
        entry["error"]
        == "skipped: needs a CUDA GPU: `python3 bench/gpu_check.py` runs it there (--smoke: toy sizes on CPU)"
    )
