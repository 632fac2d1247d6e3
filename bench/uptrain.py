"""Speed of the uptrain loop vs a minimal hand-written torch loop, side by side in one run (CPU).

Both train the same model (the embedded default's architecture, recipes/austen-mha-config.json,
randomly initialised with the same seed) on the same packed Austen blocks, with the same batch,
seq_len and optimizer (fused AdamW, grad clip 1.0). The hand-written loop is: forward with labels,
backward, clip, step, zero_grad.

Two modes, because a shared 2-core machine makes wall time mostly a measure of the neighbours:
- paired (default): the loop's own per-step code (mha2gqa.uptrain.steps.optimizer_step: LR,
  accelerate's accumulate/backward, clip, NaN guard, step; plus the metrics bookkeeping run_steps
  does) and the hand-written step alternate step by step (ABBA) in one process, on two identical
  models; overhead = median over step pairs of (our step time / hand step time) - 1. Neighbour load
  changes over seconds to minutes, so it hits both sides of a pair alike.
- runs: whole mha2gqa.uptrain.train() runs (setup, tqdm, metrics.jsonl, everything) against
  hand-written runs, alternating ABBA; rates from metrics.jsonl intervals, first (warm-up) and last
  (final eval) intervals dropped. Closest to real use, noisiest here.
Each reports tokens per wall second and per CPU second of this process.
- profile: one train() run under cProfile; run_steps' time minus the work the hand-written loop does
  too (forward with loss, backward, clip, AdamW step) and minus the final eval, over that work.

    python bench/uptrain.py                     # paired: 40 step pairs, seq_len 512, batch 8
    python bench/uptrain.py --mode runs         # 8 ABBA pairs of 12-step train() runs
    python bench/uptrain.py --mode both --seq-len 256
    python bench/uptrain.py --mode profile --steps 15
    python bench/uptrain.py --smoke --json /tmp/u.json   # every mode at toy sizes (run by a test)

The runs mode uses only the public load_recipe/train. The paired and profile modes time the loop's
per-step code, which has no public entry point, so they reach into mha2gqa.uptrain's modules by name;
tests/test_bench_smoke.py runs --smoke so a rename there breaks a test, not a later measurement.
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
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _handloop import hand_optimizer, hand_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "austen-mha-config.json"
TOKENIZER = ROOT / "mha2gqa" / "data" / "austen-mha"
NOVEL = ROOT / "mha2gqa" / "data" / "austen" / "emma.txt.gz"


def recipe_dict(args, out: Path, **extra) -> dict:
    return {
        "init_from_config": str(args.config),
        "tokenizer": str(args.tokenizer),
        "output_dir": str(out),
        "seed": 0,
        "seq_len": args.seq_len,
        "micro_batch_size": args.batch,
        "grad_accum": 1,
        "mixed_precision": args.precision,
        "log_every": args.interval,
        "eval_every": 0,
        "eval_at_start": False,
        "save_every": 0,
        "tensorboard": False,
        "data": {"train": [str(args.data)], "eval_blocks": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 5, "weight_decay": 0.1, "grad_clip": 1.0},
        "budget": {"max_steps": args.steps},
        **extra,
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


def hand_setup(args, work: Path, steps: int):
    """The same model, blocks and optimizer, built outside the timed part."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mha2gqa.uptrain import load_recipe
    from mha2gqa.uptrain.data import build_data

    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(args, work / "unused")))
    recipe = load_recipe(path, [])
    data = build_data(recipe, AutoTokenizer.from_pretrained(args.tokenizer), 0, 1, show_progress=False)
    batches = [data.train.batch(m) for m in range(steps)]  # (batch, seq_len) int64 each
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), dtype=torch.float32)
    return model.train(), batches


def run_hand(args, work: Path) -> list[tuple[float, float]]:
    """The minimal loop: forward with labels, backward, clip, fused AdamW step."""
    model, batches = hand_setup(args, work, args.steps)
    optimizer = hand_optimizer(model, lr=1e-3)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    rates, start, cpu_start = [], time.perf_counter(), time.process_time()
    for step, batch in enumerate(batches, 1):
        hand_step(model, model, optimizer, batch, autocast)
        if step % args.interval == 0:
            now, cpu = time.perf_counter(), time.process_time()
            tokens = args.interval * batch.numel()
            rates.append((tokens / (now - start), tokens / (cpu - cpu_start)))
            start, cpu_start = now, cpu
    return rates[1:-1]


def run_paired(args, work: Path) -> dict:
    """Alternate our optimizer step and the hand-written one, step by step, on identical models."""
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from mha2gqa.uptrain import load_recipe
    from mha2gqa.uptrain.data import build_data
    from mha2gqa.uptrain.models import load_student, make_optimizer
    from mha2gqa.uptrain.reporting import Metrics
    from mha2gqa.uptrain.steps import Run, loss_function, optimizer_step

    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(args, work / "paired", budget={"max_steps": args.pairs})))
    recipe = load_recipe(path, [])
    acc = Accelerator(gradient_accumulation_steps=1, mixed_precision=args.precision)
    data = build_data(recipe, AutoTokenizer.from_pretrained(args.tokenizer), 0, 1, show_progress=False)
    student = load_student(recipe)  # seeded init, the same weights as the hand model below
    model, optimizer = acc.prepare(student.model, make_optimizer(student.model, recipe.optim, "cpu"))
    (work / "paired").mkdir(exist_ok=True)
    metrics = Metrics(work / "paired", acc, -1, args.pairs, tensorboard=False)
    run = Run(recipe, acc, model, optimizer, None, data, work / "paired", args.pairs, metrics, None)
    loss_fn, ours_batches = loss_function(run, model), data.train.batches(0)
    hand_model, hand_batches = hand_setup(args, work, args.pairs)
    hand_opt = hand_optimizer(hand_model, lr=1e-3)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    tokens = args.seq_len * args.batch

    def ours(step):
        loss, grad_norm, lr = optimizer_step(run, model, loss_fn, ours_batches, step)
        metrics.step(loss, tokens)  # what run_steps adds per step, and a metrics line per interval
        if (step + 1) % args.interval == 0:
            metrics.write(step + 1, (step + 1) * tokens, lr, grad_norm)

    def hand(step):
        hand_step(hand_model, hand_model, hand_opt, hand_batches[step], autocast)

    times = {"uptrain": [], "hand": []}
    for step in range(args.pairs):
        for name, fn in [("uptrain", ours), ("hand", hand)][:: 1 if step % 2 == 0 else -1]:
            wall, cpu = time.perf_counter(), time.process_time()
            fn(step)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    metrics.close()
    return {name: t[2:] for name, t in times.items()}  # the first two steps warm up allocators


def run_profile(args, work: Path) -> dict:
    """cProfile one train() run and split run_steps' time into the work a hand-written loop also does
    (forward with loss, backward, clip, AdamW step) and everything else (the loop's own overhead).
    Both parts are measured in the same steps, so load from other processes largely cancels; the
    profiler's per-call cost lands mostly on the Python bookkeeping, so this overstates our overhead."""
    import cProfile
    import inspect
    import pstats

    from mha2gqa.uptrain import load_recipe, steps, train

    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(args, work / f"profile-{time.monotonic_ns()}")))
    recipe = load_recipe(path, [])
    profiler = cProfile.Profile()
    profiler.runcall(train, recipe)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, ncalls, tottime, cumtime, callers)}

    def cumulative(function) -> float:
        """Cumulative seconds in `function` (its own code, under any decorator); a function the run
        never entered is an error, so a rename cannot silently report 0."""
        code = inspect.unwrap(function).__code__
        key = (code.co_filename, code.co_firstlineno, code.co_name)
        if key not in stats:
            raise SystemExit(f"profile: {function.__qualname__} was never called; update bench/uptrain.py")
        return stats[key][3]

    parts = {
        "run_steps": cumulative(steps.run_steps),
        "eval": cumulative(steps.evaluate),  # every eval goes through it (steps._evaluate wraps it in a dict)
        "forward+loss": cumulative(steps.lm_loss) - cumulative(steps.evaluate),
        "backward": cumulative(torch.Tensor.backward),
        "clip": cumulative(torch.nn.utils.clip_grad_norm_),
        "adamw": cumulative(torch.optim.AdamW.step),  # AdamW inherits Adam.step
    }
    compute = parts["forward+loss"] + parts["backward"] + parts["clip"] + parts["adamw"]
    parts["loop_overhead_s"] = parts["run_steps"] - parts["eval"] - compute
    parts["overhead"] = parts["loop_overhead_s"] / compute
    print("\n| run_steps (s) | of which eval | forward+loss | backward | clip | AdamW | everything else | overhead |")
    print("|---|---|---|---|---|---|---|---|")
    cells = [
        f"{parts[k]:.2f}" for k in ("run_steps", "eval", "forward+loss", "backward", "clip", "adamw", "loop_overhead_s")
    ]
    print("| " + " | ".join(cells) + f" | {100 * parts['overhead']:+.2f}% |")
    return parts


def _report_paired(times: dict, tokens: int, result: dict) -> None:
    print(f"\n| paired steps ({len(times['hand'])} pairs, medians) | hand-written | uptrain | overhead |")
    print("|---|---|---|---|")
    for i, name in enumerate(["tokens / wall second", "tokens / process CPU second"]):
        ours = [t[i] for t in times["uptrain"]]
        hand = [t[i] for t in times["hand"]]
        overhead = statistics.median(o / h for o, h in zip(ours, hand)) - 1
        result[f"paired {name}"] = {
            "uptrain": tokens / statistics.median(ours),
            "hand": tokens / statistics.median(hand),
            "median_overhead": overhead,
        }
        print(
            f"| {name} | {tokens / statistics.median(hand):.0f} | {tokens / statistics.median(ours):.0f} | "
            f"{100 * overhead:+.1f}% |"
        )


def _report_runs(runs: list, result: dict) -> None:
    print(f"\n| whole runs ({len(runs)} ABBA repeats, median of per-run medians) | hand-written | uptrain | overhead |")
    print("|---|---|---|---|")
    for i, name in enumerate(["tokens / wall second", "tokens / process CPU second"]):
        ours = [statistics.median(r[i] for r in run["uptrain"]) for run in runs]
        hand = [statistics.median(r[i] for r in run["hand"]) for run in runs]
        overhead = statistics.median(h / o for o, h in zip(ours, hand)) - 1
        result[f"runs {name}"] = {"uptrain": ours, "hand": hand, "median_overhead": overhead}
        print(f"| {name} | {statistics.median(hand):.0f} | {statistics.median(ours):.0f} | {100 * overhead:+.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["paired", "runs", "both", "profile"], default="paired")
    parser.add_argument("--pairs", type=int, default=40, help="paired mode: step pairs")
    parser.add_argument("--steps", type=int, default=12, help="runs mode: optimizer steps per run")
    parser.add_argument("--interval", type=int, default=3, help="steps per metrics interval")
    parser.add_argument("--repeats", type=int, default=8, help="runs mode: runs of each loop, in ABBA order")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", choices=["no", "bf16"], default="no")
    parser.add_argument("--config", type=Path, default=CONFIG, help="model config.json (random init)")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    parser.add_argument("--data", type=Path, default=NOVEL, help="training text (one novel by default)")
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "uptrain.json", help="where results go")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="modes both and profile at toy sizes (4 pairs, 1 run of 6 steps each, seq_len 32, batch 2): seconds",
    )
    args = parser.parse_args()
    if args.smoke:
        args.mode, args.pairs, args.steps, args.interval, args.repeats, args.seq_len, args.batch = (
            "both",
            4,
            6,
            2,
            1,
            32,
            2,
        )

    result = {
        "threads": torch.get_num_threads(),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "precision": args.precision,
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.mode in ("paired", "both"):
            times = run_paired(args, Path(tmp))
            result["paired_step_seconds"] = times
            _report_paired(times, args.seq_len * args.batch, result)
        if args.mode == "profile" or args.smoke:
            result["profile"] = run_profile(args, Path(tmp))
        if args.mode in ("runs", "both"):
            runs = []
            for repeat in range(args.repeats):
                order = [("uptrain", run_ours), ("hand", run_hand)][:: 1 if repeat % 2 == 0 else -1]
                runs.append({name: fn(args, Path(tmp)) for name, fn in order})
            result["runs_intervals"] = runs
            _report_runs(runs, result)
    print("\noverhead: uptrain time / hand-written time - 1 (target <= +5%)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
