"""What the GPU tests share: the marker that skips them without CUDA, the sizes, a random Llama checkpoint,
a timer with peak memory, tensor loading and comparison, and a small uptrain recipe."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # the bench scripts; the package, uninstalled on the GPU machine

from mha2gqa.files import embedded  # noqa: E402

SMOKE = os.environ.get("GPU_CHECK_SMOKE") == "1"
# Every module of tests/gpu: marked `gpu`, skipped where torch sees no CUDA unless gpu_check --smoke asked for
# the toy sizes on CPU.
MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (SMOKE or torch.cuda.is_available()),
        reason="needs a CUDA GPU: `python3 bench/gpu_check.py` runs it there (--smoke: toy sizes on CPU)",
    ),
]
# The sizes. Llama-2-shaped at 1B: 20 layers of hidden 2048, 32 heads of 64 (an MHA source).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=32, head_dim=64)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, head_dim=8)
SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, head_dim=32)
STEPS = 5


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


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


def needs(*modules: str) -> None:
    """Fail with how to bring them when modules the part imports are missing (the GPU machine has no datasets
    and no bitsandbytes): gpu_check installs wheels from bench/wheels, which scripts/gpu_wheels.py fills."""
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"needs {', '.join(missing)}, not installed here: `python scripts/gpu_wheels.py bench/wheels` prints "
            "how to bring the wheels, which bench/gpu_check.py installs from bench/wheels"
        )
