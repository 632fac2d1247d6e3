"""Part 3 of bench/gpu_check.py: convert --method calibrated --refine of a random ~1B Llama-shaped MHA checkpoint
(32 -> 8 kv heads; toy: 8 -> 2) on the embedded calibration text, each stage timed apart (statistics gathered once,
as a sweep does) with its peak memory; then a tiny refine on CUDA and on CPU, whose weights must agree."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from gpu_common import LLAMA_1B, MARKS, ROOT, TOY, device, embedded, load_tensors, random_llama, timed

pytestmark = MARKS


def test_convert_refine(part):
    from mha2gqa import convert
    from mha2gqa.architecture.layouts import attention_shape, layout_for, read_config
    from mha2gqa.convert.calibration import calibrate
    from mha2gqa.convert.options import DEFAULT_CALIBRATION_TOKENS, RefineOptions

    work, smoke = part.work, part.smoke
    dims, groups = (TOY, 2) if smoke else (LLAMA_1B, 8)
    tokens = 2048 if smoke else DEFAULT_CALIBRATION_TOKENS  # smoke: 4 blocks of 512, 10 Adam steps a layer
    refine = RefineOptions(steps=10) if smoke else RefineOptions()
    source, params = random_llama(work / "source", dims, torch.float32 if smoke else torch.bfloat16)
    config = read_config(source)
    text = [str(p) for p in embedded.train_paths()]  # what --calibration austen names
    stages = {}
    (work / "stats").mkdir()
    stats, stages["calibration"] = timed(
        lambda: calibrate(
            source, layout_for(config), attention_shape(config), text, tokens, work / "stats", progress=False
        )
    )
    options = dict(groups=groups, method="calibrated", stats=stats, progress=False)
    _, stages["merge"] = timed(lambda: convert(source, work / "merged", **options))
    shutil.rmtree(work / "merged")
    refined, stages["merge+refine"] = timed(lambda: convert(source, work / "refined", refine=refine, **options))
    record = refined.refine
    stages["refine"] = {"seconds": record["wall_s"], "peak_memory_bytes": stages["merge+refine"]["peak_memory_bytes"]}
    layers = record["layers"]
    part.result = result = {
        "params": params,
        "kv_heads": f"{dims['num_attention_heads']} -> {groups}",
        "calibration_tokens": tokens,
        "refine_fit_tokens": record["fit_tokens"],
        "refine_device": record["device"],
        "refine_spilled_to_disk": record["spilled_to_disk"],
        "stages": stages,
        "user_total_s": round(stages["calibration"]["seconds"] + stages["merge+refine"]["seconds"], 2),
        "heldout_error_before_mean": sum(x["heldout_error_before"] for x in layers) / len(layers),
        "heldout_error_after_mean": sum(x["heldout_error_after"] for x in layers) / len(layers),
    }
    assert torch.device(result["refine_device"]).type == device().type  # "cuda:0" on a GPU
    assert 0 < result["heldout_error_after_mean"] <= result["heldout_error_before_mean"]  # refine keeps only gains
    if device().type != "cuda":
        part.skip("CUDA vs CPU refined weights", "needs CUDA")
        return
    result["cuda_vs_cpu"] = agreement = cuda_vs_cpu(work, text)
    assert agreement["same_tensors"] and agreement["max_relative_diff"] <= 1e-3, agreement


def tiny_convert(source: Path, dst: Path, text: list[str]) -> None:
    """The refine of the CUDA-vs-CPU check (the same call in both processes): the layer-wise stage, whose
    arithmetic must agree. The global stage (timed on CUDA above) keeps its best held-out check, a discrete
    choice that float noise between devices may flip, so it is left out here."""
    from mha2gqa import convert
    from mha2gqa.convert.options import RefineOptions

    convert(source, dst, groups=2, method="calibrated", calibration=text, calibration_tokens=8192,
            refine=RefineOptions(global_steps=0), progress=False)  # fmt: skip


def cuda_vs_cpu(work: Path, text: list[str]) -> dict:
    """The same tiny fp32 conversion with --refine on this GPU and, in a child process that sees no GPU, on
    the CPU: how far apart every tensor ends (relative to the tensor's largest entry)."""
    source, _ = random_llama(work / "tiny-source", TOY, torch.float32)
    tiny_convert(source, work / "tiny-cuda", text)
    script = "import sys, test_convert_refine as t; t.tiny_convert(*map(t.Path, sys.argv[1:3]), sys.argv[3:])"
    here = os.pathsep.join([str(Path(__file__).parent), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": here}
    subprocess.run([sys.executable, "-c", script, str(source), str(work / "tiny-cpu"), *text], env=env, check=True)
    on_gpu, on_cpu = load_tensors(work / "tiny-cuda"), load_tensors(work / "tiny-cpu")
    worst, worst_relative = 0.0, 0.0
    for name, a in on_gpu.items():
        if name not in on_cpu:
            continue
        diff = (a.double() - on_cpu[name].double()).abs().max().item()
        worst = max(worst, diff)
        worst_relative = max(worst_relative, diff / max(a.double().abs().max().item(), 1e-30))
    return {
        "tensors": len(on_gpu),
        "same_tensors": set(on_gpu) == set(on_cpu),
        "max_abs_diff": worst,
        "max_relative_diff": worst_relative,
    }
