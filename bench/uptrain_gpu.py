"""Tokens/s and MFU of the uptrain loop on one GPU: a ~1B Llama-shaped model, bf16, SDPA, torch.compile.

Meant for the GPU machine when one is lent (about 3-4 minutes on one H200; most of it is model init
and compilation). NOT RUN on the development machines, which have no GPU.

FLOPs per token = 6 * N + 12 * layers * seq_len * hidden, with N the parameters that do matmuls
(everything but the input embedding lookup) and the attention term counted in full (the PaLM
convention; causal masking halves what is strictly needed). MFU = tokens/s * FLOPs per token / peak,
peak = 989 TFLOP/s dense bf16 (H100/H200 SXM). Target: MFU >= 45%.

    python bench/uptrain_gpu.py                     # 1.0B model, seq 2048, batch 16, 40 steps
    python bench/uptrain_gpu.py --baseline          # also a hand-written compiled loop, same settings
    python bench/uptrain_gpu.py --smoke --baseline  # the same code on CPU: a 2-layer toy, fp32, no compile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _handloop import hand_optimizer, hand_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "mha2gqa" / "data" / "austen-mha"
NOVELS = sorted((ROOT / "mha2gqa" / "data" / "austen").glob("*.txt.gz"))
PEAK_FLOPS = 989e12


def llama_1b(layers: int, kv_heads: int) -> dict:
    """Llama-2-shaped: hidden 2048, 32 heads of 64, SwiGLU 5632, vocab 32000; GQA as after conversion."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": kv_heads,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def toy(kv_heads: int) -> dict:
    """--smoke: the same family at toy size (hidden 64, 2 layers, 8 heads of 8) so the code runs on CPU in seconds."""
    return {
        **llama_1b(2, kv_heads),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 8,
        "head_dim": 8,
    }


def flops_per_token(config: dict, matmul_params: int, seq_len: int) -> float:
    return 6 * matmul_params + 12 * config["num_hidden_layers"] * seq_len * config["hidden_size"]


def matmul_params(config: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)


def run_uptrain(args, work: Path, config_path: Path) -> tuple[list[float], float]:
    from mha2gqa.uptrain import load_recipe, train

    out = work / "out"
    work.mkdir(exist_ok=True)
    recipe = {
        "init_from_config": str(config_path),
        "tokenizer": str(TOKENIZER),
        "output_dir": str(out),
        "seq_len": args.seq_len,
        "micro_batch_size": args.batch,
        "grad_accum": 1,
        "mixed_precision": args.precision,
        "attn_implementation": "sdpa",
        "compile": not args.no_compile,
        "log_every": args.interval,
        "eval_every": 0,
        "eval_at_start": False,
        "save_every": 0,
        "tensorboard": False,
        "data": {"train": [str(p) for p in NOVELS if "persuasion" not in p.name], "eval_blocks": 1},
        "optim": {"lr": 3e-4, "warmup_steps": 10},
        "budget": {"max_steps": args.steps},
    }
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train(load_recipe(work / "recipe.yaml", []))
    rates = [json.loads(ln)["tokens_per_s"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    # drop the compile/warm-up intervals and the last one (it holds the final eval)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    return rates[args.warmup_intervals : -1], peak


def run_baseline(args, config: dict) -> list[float]:
    """The minimal loop with the same model, batch, optimizer, precision and compilation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = (
        AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config), dtype=torch.float32, attn_implementation="sdpa"
        )
        .to(args.device)
        .train()
    )
    optimizer = hand_optimizer(model, lr=3e-4)
    forward = model if args.no_compile else torch.compile(model)
    batch = torch.randint(3, 4096, (args.batch, args.seq_len), device=args.device)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    rates, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        hand_step(forward, model, optimizer, batch, autocast)
        if step % args.interval == 0:
            if args.device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            rates.append(args.interval * batch.numel() / (now - start))
            start = now
    return rates[args.warmup_intervals :]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20, help="decoder layers (20: 1.03B parameters)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--warmup-intervals", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--baseline", action="store_true", help="also time a hand-written loop")
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ROOT / ".bench")) / "uptrain_gpu.json")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="run the same code on CPU at toy size (2 layers, seq 32, batch 2, 6 steps, fp32, no compile)",
    )
    args = parser.parse_args(argv)
    args.device, args.precision = "cuda", "bf16"
    if args.smoke:
        args.device, args.precision, args.no_compile = "cpu", "no", True
        args.seq_len, args.batch, args.steps, args.interval, args.warmup_intervals = 32, 2, 6, 2, 1
    elif not torch.cuda.is_available():
        raise SystemExit("bench/uptrain_gpu.py needs a CUDA GPU; use bench/uptrain.py on CPU, or --smoke")

    config = toy(args.kv_heads) if args.smoke else llama_1b(args.layers, args.kv_heads)
    params = matmul_params(config)
    per_token = flops_per_token(config, params, args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = (
            Path(tmp) / "config" / "config.json"
        )  # not beside output_dir: uptrain refuses to write into its source
        config_path.parent.mkdir()
        config_path.write_text(json.dumps(config))
        rates, peak_gib = run_uptrain(args, Path(tmp) / "run", config_path)
    result = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke)",
        "matmul_params": params,
        "flops_per_token": per_token,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "compile": not args.no_compile,
        "uptrain_tok_s": statistics.median(rates),
        "uptrain_intervals": rates,
        "peak_mem_gib": peak_gib,
    }
    result["mfu"] = result["uptrain_tok_s"] * per_token / PEAK_FLOPS
    print(f"{result['gpu']}: {params / 1e9:.2f}B matmul params, {per_token / 1e9:.2f} GFLOP/token")
    print(
        f"uptrain loop: {result['uptrain_tok_s']:.0f} tok/s, MFU {100 * result['mfu']:.1f}% "
        f"(target >= 45%), peak memory " + (f"{peak_gib:.1f} GiB" if peak_gib is not None else "not measured on CPU")
    )
    if args.baseline:
        base = statistics.median(run_baseline(args, config))
        result.update(hand_tok_s=base, overhead=base / result["uptrain_tok_s"] - 1)
        print(f"hand-written loop: {base:.0f} tok/s; uptrain overhead {100 * result['overhead']:+.1f}%")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
