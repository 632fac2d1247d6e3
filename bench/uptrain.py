"""Tokens/s of the uptrain loop vs a minimal hand-written torch loop, side by side in one run (CPU).

Both train the same model (the embedded default's architecture, recipes/austen-mha-config.json,
randomly initialised with the same seed) on the same packed Austen blocks, with the same batch,
seq_len and optimizer (fused AdamW, grad clip 1.0). The uptrain loop is mha2gqa.uptrain.train()
itself, with everything a real run does per step (accelerate's accumulate, the NaN guard, the LR
schedule, tqdm, metrics.jsonl); its rates are read from metrics.jsonl, whose intervals cover all
of that. Runs alternate (ours, hand, ours, hand ...) so that load from other processes hits both;
the first interval of each run (warm-up) and the last (it includes the final eval) are dropped.
Two measures: tokens per wall second, and tokens per CPU second of this process (steadier on a
machine shared with other jobs, where wall time mostly measures the neighbours).

    python bench/uptrain.py                 # defaults: seq_len 512, batch 8, 4 repeats of 25 steps
    python bench/uptrain.py --repeats 2 --steps 15 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "austen-mha-config.json"
TOKENIZER = ROOT / "mha2gqa" / "data" / "austen-mha"
NOVEL = ROOT / "mha2gqa" / "data" / "austen" / "emma.txt.gz"


def recipe_dict(args, out: Path, **extra) -> dict:
    return {
        "init_from_config": str(args.config), "tokenizer": str(args.tokenizer), "output_dir": str(out),
        "seed": 0, "seq_len": args.seq_len, "micro_batch_size": args.batch, "grad_accum": 1,
        "mixed_precision": args.precision, "log_every": args.interval, "eval_every": 0, "eval_at_start": False,
        "save_every": 0, "tensorboard": False,
        "data": {"train": [str(args.data)], "eval_blocks": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 5, "weight_decay": 0.1, "grad_clip": 1.0},
        "budget": {"max_steps": args.steps}, **extra,
    }


def run_ours(args, work: Path) -> list[tuple[float, float]]:
    """(tokens per wall second, tokens per process-CPU second) per metrics interval of a real train() run."""
    from mha2gqa.uptrain import load_recipe, train

    out = work / f"ours-{time.monotonic_ns()}"
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(args, out)))
    train(load_recipe(path, []))
    tokens = args.interval * args.seq_len * args.batch
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(ln["tokens_per_s"], tokens / ln["cpu_s"]) for ln in lines][1:-1]


def hand_setup(args, work: Path):
    """The same model, blocks and optimizer, built outside the timed part."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mha2gqa.uptrain import load_recipe
    from mha2gqa.uptrain.data_setup import build_data

    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(args, work / "unused")))
    recipe = load_recipe(path, [])
    data = build_data(recipe, AutoTokenizer.from_pretrained(args.tokenizer), 0, 1, show_progress=False)
    batches = [data.train.batch(m) for m in range(args.steps)]  # (batch, seq_len) int64 each
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), dtype=torch.float32)
    return model.train(), batches


def run_hand(args, work: Path) -> list[tuple[float, float]]:
    """The minimal loop: forward with labels, backward, clip, fused AdamW step."""
    model, batches = hand_setup(args, work)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    rates, start, cpu_start = [], time.perf_counter(), time.process_time()
    for step, batch in enumerate(batches, 1):
        with autocast:
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.interval == 0:
            now, cpu = time.perf_counter(), time.process_time()
            tokens = args.interval * batch.numel()
            rates.append((tokens / (now - start), tokens / (cpu - cpu_start)))
            start, cpu_start = now, cpu
    return rates[1:-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    parser.add_argument("--interval", type=int, default=5, help="steps per measured interval")
    parser.add_argument("--repeats", type=int, default=4, help="runs of each loop, alternating")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", choices=["no", "bf16"], default="no")
    parser.add_argument("--config", type=Path, default=CONFIG, help="model config.json (random init)")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    parser.add_argument("--data", type=Path, default=NOVEL, help="training text (one novel by default)")
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "uptrain.json", help="where results go")
    args = parser.parse_args()

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            runs.append({"uptrain": run_ours(args, Path(tmp)), "hand": run_hand(args, Path(tmp))})
            med = {k: [statistics.median(r[i] for r in v) for i in (0, 1)] for k, v in runs[-1].items()}
            print(f"repeat {repeat + 1}: tok/s uptrain {med['uptrain'][0]:6.0f} hand {med['hand'][0]:6.0f} | "
                  f"tok/CPU-s uptrain {med['uptrain'][1]:6.0f} hand {med['hand'][1]:6.0f}", flush=True)
    result = {"threads": torch.get_num_threads(), "seq_len": args.seq_len, "batch": args.batch,
              "precision": args.precision, "intervals": runs}
    print(f"\n| measure (median over {args.repeats} repeats of the per-run medians) | hand-written | uptrain | overhead |")
    print("|---|---|---|---|")
    for i, name in enumerate(["tokens / wall second", "tokens / process CPU second"]):
        ours = [statistics.median(r[i] for r in run["uptrain"]) for run in runs]
        hand = [statistics.median(r[i] for r in run["hand"]) for run in runs]
        overhead = statistics.median(h / o for o, h in zip(ours, hand)) - 1
        result[name] = {"uptrain": ours, "hand": hand, "median_overhead": overhead}
        print(f"| {name} | {statistics.median(hand):.0f} | {statistics.median(ours):.0f} | {100 * overhead:+.1f}% |")
    print("\noverhead = median over repeats of (hand / uptrain) - 1; target <= +5%")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
