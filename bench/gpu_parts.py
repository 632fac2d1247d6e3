"""The five parts of bench/gpu_check.py, one per process: `python bench/gpu_parts.py PART --work DIR --result FILE`.

Each part writes {"result": {...}, "skipped": [...]} to FILE, or {"error": ..., "skipped": [...]} and re-raises
(the traceback goes to the output, which gpu_check.py keeps). --smoke: toy sizes on CPU; what needs CUDA is
skipped and said so. Run through gpu_check.py, which sets PYTHONPATH, the time limits and the report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # the bench scripts; the package, uninstalled on the GPU machine

from mha2gqa import embedded  # noqa: E402

# The sizes: (full, smoke). Llama-2-shaped at 1B: 20 layers of hidden 2048, 32 heads of 64 (an MHA source).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=32, head_dim=64)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, head_dim=8)
SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, head_dim=32)
STEPS = 5
NEEDS = {  # modules a part imports beyond torch and transformers (the GPU machine lacks datasets and bitsandbytes)
    "uptrain_gpu": ("datasets", "accelerate"),
    "fsdp": ("datasets", "accelerate"),
    "qlora": ("datasets", "peft"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--work", type=Path, required=True, help="scratch folder of this part")
    parser.add_argument("--result", type=Path, required=True, help="where the part's JSON goes")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--fail", action="store_true", help="raise at the start (tests the failure recording)")
    args = parser.parse_args(argv)
    skipped: list[dict] = []
    try:
        if args.fail:
            raise RuntimeError(f"deliberate failure of part {args.part} (--fail {args.part})")
        check_needs(args.part, args.smoke)
        result = PARTS[args.part](args.work, args.smoke, skipped)
    except BaseException as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        write_json(args.result, {"error": f"{type(err).__name__}: {message}"[:500], "skipped": skipped})
        raise
    write_json(args.result, {"result": result, "skipped": skipped})
    return 0


def check_needs(part: str, smoke: bool) -> None:
    if not smoke and not torch.cuda.is_available():
        raise RuntimeError(f"part {part} needs a CUDA GPU and torch sees none: run gpu_check.py --smoke on a CPU")
    needs = NEEDS.get(part, ()) + (("bitsandbytes",) if part == "qlora" and not smoke else ())
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"part {part} needs {', '.join(missing)}, not installed here: `python bench/gpu_check.py --wheels "
            "bench/wheels` prints how to bring wheels, which gpu_check.py installs from bench/wheels"
        )


def skip(skipped: list[dict], what: str, reason: str) -> None:
    skipped.append({"what": what, "reason": reason})


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---- 1, 2: the existing GPU benchmarks ----


def eval_gpu(work: Path, smoke: bool, skipped: list[dict]) -> dict:
    import eval_gpu as bench

    out = work / "eval_gpu.json"
    bench.main(["--preset", "cpu-tiny" if smoke else "h200", "--out", str(out)])
    if smoke:
        skip(skipped, "CUDA graphs", "need CUDA: on CPU the graph rows time a plain StaticCache decode")
    return json.loads(out.read_text())


def uptrain_gpu(work: Path, smoke: bool, skipped: list[dict]) -> dict:
    import uptrain_gpu as bench

    out = work / "uptrain_gpu.json"
    bench.main(["--baseline", "--json", str(out), *(["--smoke"] if smoke else [])])
    if smoke:
        skip(skipped, "bf16, torch.compile and MFU", "need CUDA: --smoke trains fp32 eager on CPU")
    return json.loads(out.read_text())


# ---- 3: convert --method calibrated --refine ----


def convert_refine(work: Path, smoke: bool, skipped: list[dict]) -> dict:
    """Calibration, merge and refine of a random Llama-shaped MHA checkpoint (32 -> 8 kv heads; toy: 8 -> 2),
    each stage timed apart (statistics gathered once, as a sweep does), with its peak memory; then a tiny
    refine on CUDA and on CPU, whose weights must agree."""
    from mha2gqa import convert
    from mha2gqa.convert.calibration import calibrate
    from mha2gqa.convert.options import DEFAULT_CALIBRATION_TOKENS, RefineOptions
    from mha2gqa.layouts import attention_shape, layout_for, read_config

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
    result = {
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
    if device().type == "cuda":
        result["cuda_vs_cpu"] = cuda_vs_cpu(work, text)
    else:
        skip(skipped, "CUDA vs CPU refined weights", "needs CUDA")
    return result


def random_llama(path: Path, dims: dict, dtype: torch.dtype) -> tuple[Path, int]:
    """A random-weight Llama MHA checkpoint with the embedded tokenizer (its vocabulary of 4096); its parameters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(embedded.MODEL_DIR)
    config = LlamaConfig(
        **dims,
        num_key_value_heads=dims["num_attention_heads"],
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device()):  # a 1B model initialises in seconds on the GPU, minutes on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def timed(run):
    """(what run() returns, {seconds, peak_memory_bytes, peak_memory_kind}), the GPU synchronised around it."""
    from mha2gqa.eval.memory import PeakMemory

    with PeakMemory(device()) as memory:
        started = time.perf_counter()
        value = run()
        if device().type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    return value, {
        "seconds": round(seconds, 2),
        "peak_memory_bytes": memory.peak_bytes,
        "peak_memory_kind": memory.kind,
    }


def tiny_convert(source: Path, dst: Path, text: list[str]) -> None:
    """The refine of the CUDA-vs-CPU check (the same call in both processes): the layer-wise stage, whose
    arithmetic must agree. The global stage (timed on CUDA by convert_refine) keeps its best held-out
    check, a discrete choice that float noise between devices may flip, so it is left out here."""
    from mha2gqa import convert
    from mha2gqa.convert.options import RefineOptions

    convert(source, dst, groups=2, method="calibrated", calibration=text, calibration_tokens=8192,
            refine=RefineOptions(global_steps=0), progress=False)  # fmt: skip


def cuda_vs_cpu(work: Path, text: list[str]) -> dict:
    """The same tiny fp32 conversion with --refine on this GPU and, in a child process that sees no GPU, on
    the CPU: every tensor must agree within float tolerance (1e-3 of the tensor's largest entry)."""
    source, _ = random_llama(work / "tiny-source", TOY, torch.float32)
    tiny_convert(source, work / "tiny-cuda", text)
    script = "import sys, gpu_parts; gpu_parts.tiny_convert(*map(gpu_parts.Path, sys.argv[1:3]), sys.argv[3:])"
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run([sys.executable, "-c", script, str(source), str(work / "tiny-cpu"), *text], env=env, check=True)
    on_gpu, on_cpu = load_tensors(work / "tiny-cuda"), load_tensors(work / "tiny-cpu")
    worst, worst_relative = 0.0, 0.0
    for name, a in on_gpu.items():
        diff = (a.double() - on_cpu[name].double()).abs().max().item()
        worst = max(worst, diff)
        worst_relative = max(worst_relative, diff / max(a.double().abs().max().item(), 1e-30))
    if set(on_gpu) != set(on_cpu) or worst_relative > 1e-3:
        raise AssertionError(f"CUDA and CPU refined weights differ: max abs {worst:.3g}, relative {worst_relative:.3g}")
    return {"tensors": len(on_gpu), "max_abs_diff": worst, "max_relative_diff": worst_relative}


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


# ---- 4: accelerate FSDP launch, final checkpoint and resume ----


def fsdp(work: Path, smoke: bool, skipped: list[dict]) -> dict:
    """5 steps under recipes/accelerate/fsdp.yaml with a checkpoint after each; the final model must load
    with plain from_pretrained and equal the step-5 checkpoint's weights; a second output_dir holding only
    the step-3 checkpoint, run with --resume, must end where the first run ended."""
    config = work / "config" / "config.json"
    write_json(config, small_config())
    first, second = work / "run", work / "resumed"
    recipe = write_recipe(work / "recipe.yaml", small_recipe(config, first, smoke))
    launch(recipe, [])
    checkpoint = first / "checkpoints" / f"step-{STEPS:08d}"
    kind, trained = checkpoint_weights(checkpoint, work / "dcp.pt")
    if not smoke and kind != "fsdp-sharded":
        raise AssertionError(f"the step-{STEPS} checkpoint is {kind}, not FSDP's sharded format: FSDP was not used")
    final, loading = load_final(first)
    result = {
        "checkpoint_format": kind,
        "loading_problems": loading,
        "final_vs_trained": compare(final, trained),
        "final_vs_step1": compare(
            final, checkpoint_weights(first / "checkpoints" / "step-00000001", work / "dcp1.pt")[1]
        ),
    }
    shutil.copytree(first / "checkpoints" / "step-00000003", second / "checkpoints" / "step-00000003")
    launch(recipe, ["--resume", f"output_dir={second}"])
    resumed, _ = load_final(second)
    losses = {
        name: {m["step"]: m["loss"] for m in metrics(run) if "loss" in m} for name, run in (("a", first), ("b", second))
    }
    result["resumed_vs_uninterrupted"] = compare(resumed, final)
    result["loss_steps_4_5"] = {
        "uninterrupted": [losses["a"][s] for s in (4, 5)],
        "resumed": [losses["b"][s] for s in (4, 5)],
    }
    problems = []
    if any(loading.values()):
        problems.append(f"from_pretrained reported {loading}")
    if not result["final_vs_trained"]["equal"]:
        problems.append(f"the final checkpoint is not the trained weights: {result['final_vs_trained']}")
    if result["final_vs_step1"]["equal"]:
        problems.append("the final weights equal the step-1 checkpoint's: nothing was trained")
    if any(abs(a - b) > 1e-4 * abs(a) for a, b in zip(*result["loss_steps_4_5"].values())):
        problems.append(f"the resumed run's losses differ: {result['loss_steps_4_5']}")
    if problems:
        raise AssertionError("; ".join(problems))
    return result


def small_config() -> dict:
    """A 4-layer GQA Llama (hidden 256, 8 heads of 32, 2 kv heads), the embedded tokenizer's vocabulary."""
    source = json.loads((embedded.MODEL_DIR / "config.json").read_text())
    keep = ("architectures", "model_type", "vocab_size", "hidden_act", "rms_norm_eps", "rope_parameters")
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {
        **{k: source[k] for k in keep + ids},
        **SMALL,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }


def small_recipe(config: Path | None, out: Path, smoke: bool, **keys) -> dict:
    """5 steps on one novel, a checkpoint after each, no eval before the end; bf16 on the GPU (as the
    accelerate configs say), fp32 on the CPU."""
    return {
        "init_from_config": str(config) if config else None,
        "tokenizer": str(embedded.MODEL_DIR),
        "output_dir": str(out),
        "seq_len": 64 if smoke else 256,
        "micro_batch_size": 2 if smoke else 8,
        "mixed_precision": "no" if smoke else "bf16",
        "log_every": 1,
        "eval_every": 0,
        "eval_at_start": False,
        "save_every": 1,
        "keep_last": STEPS,
        "tensorboard": False,
        "data": {"train": [str(embedded.novel_path("northangerabbey"))], "eval_blocks": 4},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "budget": {"max_steps": STEPS},
        **keys,
    }


def write_recipe(path: Path, recipe: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({k: v for k, v in recipe.items() if v is not None}))
    return path


def launch(recipe: Path, args: list[str]) -> None:
    with socket.socket() as sock:  # a free port for the launcher's process group
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "recipes/accelerate/fsdp.yaml"),
    ]
    command += [
        "--num_processes",
        "1",
        "--main_process_port",
        port,
        "-m",
        "mha2gqa.uptrain",
        "--recipe",
        str(recipe),
        *args,
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def checkpoint_weights(checkpoint: Path, scratch: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """The model weights of an accelerate save_state folder: FSDP's sharded torch.distributed.checkpoint
    folder (gathered into one file with DCP's own converter), or a plain model.safetensors."""
    sharded = sorted(checkpoint.glob("pytorch_model_fsdp_*"))
    if sharded:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(sharded[0], scratch)
        state = torch.load(scratch, map_location="cpu", weights_only=True)
        return "fsdp-sharded", state.get("model", state)
    if any(checkpoint.glob("model*.safetensors")):
        return "safetensors", load_tensors(checkpoint)
    raise AssertionError(f"{checkpoint} holds no model weights: {sorted(p.name for p in checkpoint.iterdir())}")


def load_final(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The final checkpoint through plain from_pretrained: its weights and the loading problems it reported."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    problems = {key: sorted(map(str, value)) for key, value in info.items()}  # missing/unexpected/mismatched keys
    return {k: v.detach() for k, v in model.state_dict().items()}, problems


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    shared = sorted(set(a) & set(b))
    diffs = [(a[k].double() - b[k].double()).abs().max().item() for k in shared]
    return {
        "tensors": len(shared),
        "only_in_one": len(set(a) ^ set(b)),
        "max_abs_diff": max(diffs, default=0.0),
        "equal": set(a) == set(b) and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in shared),
    }


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ---- 5: QLoRA ----


def qlora(work: Path, smoke: bool, skipped: list[dict]) -> dict:
    """trainable: lora with lora.load_in_4bit on the embedded model, 5 steps, merged: the result loads
    with plain from_pretrained, holds no quantization config, changed only the adapted projections."""
    from mha2gqa.provenance import latest
    from mha2gqa.uptrain import load_recipe, train

    out = work / "run"
    recipe = small_recipe(None, out, smoke, model=str(embedded.MODEL_DIR), trainable="lora", save_every=0)
    recipe["lora"] = {"load_in_4bit": not smoke}
    if smoke:
        skip(skipped, "load_in_4bit (QLoRA)", "needs CUDA and bitsandbytes: plain LoRA through the same code")
    train(load_recipe(write_recipe(work / "recipe.yaml", recipe), []))
    merged, loading = load_final(out)
    source = load_tensors(embedded.MODEL_DIR)
    changed = sorted(k for k in merged if k in source and not torch.equal(merged[k], source[k]))
    stage = latest(out, "uptrain")
    config = json.loads((out / "config.json").read_text())
    result = {
        "loading_problems": loading,
        "quantization_config_left": "quantization_config" in config,
        "saved_dtype": config.get("dtype"),
        "changed_tensors": len(changed),
        "changed_outside_attention": [k for k in changed if ".self_attn." not in k],
        "adapter": stage.get("adapter"),
        "final_eval_loss": stage.get("final_eval_loss"),
        "all_finite": all(bool(torch.isfinite(t).all()) for t in merged.values()),
    }
    problems = [f"from_pretrained reported {loading}"] if any(loading.values()) else []
    if result["quantization_config_left"] or not result["all_finite"] or not changed:
        problems.append(f"the merged checkpoint is not a plain trained model: {result}")
    if result["changed_outside_attention"]:
        problems.append(f"tensors outside the adapted projections changed: {result['changed_outside_attention']}")
    if problems:
        raise AssertionError("; ".join(problems))
    return result


PARTS = {
    "eval_gpu": eval_gpu,
    "uptrain_gpu": uptrain_gpu,
    "convert_refine": convert_refine,
    "fsdp": fsdp,
    "qlora": qlora,
}

if __name__ == "__main__":
    sys.exit(main())
