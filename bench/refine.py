"""Measurement: `convert --refine` at alpha = 0 (no training): held-out perplexity, gap closed, wall
time and peak memory of each conversion, and refinement time against calibration time.

    python bench/refine.py --out refine-austen.json                          # the embedded Austen model
    python bench/refine.py --model DIR --context 256 --out refine-small.json  # the second model
    python bench/refine.py --explore --kv 2 --methods calibrated             # fit settings, side by side
    python bench/refine.py --timing 5 --kv 1 --methods calibrated            # refine vs calibration time only
    python bench/refine.py --smoke                                           # seconds; run by a test

Grid: kv heads (--kv) x methods (--methods) x {merge only, merge + --refine}. Each conversion is the
real CLI in a child process (`mha2gqa convert ... --calibration DATA [--refine]`), so its wall time
and peak RSS are what a user pays, calibration included. Calibration alone is timed once in this
process. Perplexity: the first --eval-tokens tokens of held-out Persuasion, non-overlapping windows of
the model's context. Gap closed = (log ppl_mean - log ppl) / (log ppl_mean - log ppl_parent), mean
being the merge-only mean-pooling row at the same kv-head count.
--explore instead runs in-process conversions from statistics gathered once, one per refine setting
(EXPLORE), to compare objectives and optimisers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure  # noqa: E402
from calibrated_merge import calibrate_on_corpus, gap_closed, heldout_ids, model_perplexity  # noqa: E402

# name -> RefineOptions fields changed from the shipped defaults ("default": none changed).
EXPLORE = {
    "default": dict(),  # the shipped RefineOptions: 128 x hidden tokens, Adam 50 steps of 4 blocks, the solve, 24 global steps
    "ls-only": dict(steps=0),
    "all-tokens": dict(tokens=1 << 40),  # every calibration token
    "b16": dict(batch_blocks=16),  # 16 blocks per Adam step
    "all-tokens-b16": dict(tokens=1 << 40, batch_blocks=16),  # the first shipped setting
    "b8": dict(batch_blocks=8),
    "t32k": dict(tokens=32768),
    "steps100": dict(steps=100),
    "steps200": dict(steps=200),
    "steps200-no-ls": dict(steps=200, solve_output=False),
    "steps200-lr3e-3": dict(steps=200, lr=3e-3),
    "layerwise": dict(global_steps=0),  # the layer-wise stage alone (the default before the global stage)
    "global-lr4e-4": dict(global_lr=4e-4),  # the global stage at twice the lr (its held-out KL still falls at step 24)
    "global48": dict(global_steps=48),  # twice the global steps
}


def convert_row(args, source: Path, out: Path, kv: int, method: str, refine: bool) -> dict:
    """One conversion through the CLI in a child process: wall time, peak RSS, the refine record."""
    command = [
        sys.executable,
        "-m",
        "mha2gqa",
        "convert",
        str(source),
        str(out),
        "--no-check",
        "--groups",
        str(kv),
        "--method",
        method,
        "--calibration",
        args.calibration,
        "--calibration-tokens",
        str(args.calibration_tokens),
        "--quiet",
        "--force",
    ]
    if refine:
        command += ["--refine", "--refine-steps", str(args.steps), "--refine-lr", str(args.lr)]
    cost = measure(command, env=dict(os.environ))
    from mha2gqa.records.provenance import latest

    record = latest(out, "conversion")
    row = {
        "kv_heads": kv,
        "method": method,
        "refine": refine,
        "convert_s": round(cost["wall_s"], 2),
        "peak_rss_mib": round(cost["peak_rss_mib"], 1),
    }
    if refine:
        layers = record["refine"]["layers"]
        row.update(
            refine_s=record["refine"]["wall_s"],
            refine_cpu_s=record["refine"].get("cpu_s"),
            heldout_error_before=_mean(layers, "heldout_error_before"),
            heldout_error_after=_mean(layers, "heldout_error_after"),
            fit_error_after=_mean(layers, "fit_error_after"),
        )
    return row


def _mean(layers: list[dict], key: str) -> float:
    return sum(row[key] for row in layers) / len(layers)


def calibration_seconds(args, source: Path) -> tuple[float, float]:
    """Wall and CPU seconds (all threads of this process) of calibration alone, model load included."""
    from mha2gqa.architecture.layouts import read_config

    config = read_config(source)
    with tempfile.TemporaryDirectory(prefix="refine-bench-stats-") as stats_dir:
        started, started_cpu = time.perf_counter(), time.process_time()
        calibrate_on_corpus(source, config, args.calibration, args.calibration_tokens, Path(stats_dir))
        return time.perf_counter() - started, time.process_time() - started_cpu


def run_grid(args, source: Path, work: Path, ids, context: int) -> list[dict]:
    rows = []
    for kv in args.kv:
        for method in args.methods:
            for refine in (False, True):
                out = work / f"{method}-kv{kv}-{'refine' if refine else 'merge'}"
                row = convert_row(args, source, out, kv, method, refine)
                row["perplexity"] = model_perplexity(out, ids, context)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def run_explore(args, source: Path, work: Path, ids, context: int) -> tuple[list[dict], tuple[float, float]]:
    from mha2gqa.architecture.layouts import read_config
    from mha2gqa.convert.refine import RefineOptions
    from mha2gqa.convert.run import convert

    config = read_config(source)
    (work / "stats").mkdir()
    started, started_cpu = time.perf_counter(), time.process_time()
    stats = calibrate_on_corpus(source, config, args.calibration, args.calibration_tokens, work / "stats")
    calibration_s = time.perf_counter() - started, time.process_time() - started_cpu
    rows = []
    for kv in args.kv:
        for method in args.methods:
            for name in ["merge"] + args.settings:
                out = work / f"{method}-kv{kv}-{name}"
                options = None if name == "merge" else RefineOptions(**EXPLORE[name])
                started = time.perf_counter()
                result = convert(
                    source, out, kv, method=method, stats=stats, refine=options, progress=False, force=True, check=False
                )
                row = {
                    "kv_heads": kv,
                    "method": method,
                    "refine": name,
                    "convert_s": round(time.perf_counter() - started, 2),
                    "perplexity": model_perplexity(out, ids, context),
                }
                if result.refine:
                    layers = result.refine["layers"]
                    row.update(refine_s=result.refine["wall_s"], refine_cpu_s=result.refine["cpu_s"])
                    row.update(
                        {
                            key: _mean(layers, key)
                            for key in ("fit_error_after", "heldout_error_before", "heldout_error_after")
                        }
                    )
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows, calibration_s


def run_timing(args, source: Path, work: Path) -> dict:
    """--timing R: R rounds, each calibration alone then a conversion with `--refine` (its defaults, but
    --steps and --lr) from those statistics, side by side in this process; medians of wall and CPU seconds
    and of each round's refine / calibration ratio (the issue's target: at most 3x on CPU)."""
    import statistics

    from mha2gqa.architecture.layouts import read_config
    from mha2gqa.convert.options import RefineOptions
    from mha2gqa.convert.run import convert

    config, rounds = read_config(source), []
    for index in range(args.timing):
        (work / f"stats-{index}").mkdir()
        started, started_cpu = time.perf_counter(), time.process_time()
        stats = calibrate_on_corpus(source, config, args.calibration, args.calibration_tokens, work / f"stats-{index}")
        calibration = time.perf_counter() - started, time.process_time() - started_cpu
        record = convert(
            source,
            work / f"out-{index}",
            args.kv[0],
            method=args.methods[0],
            stats=stats,
            refine=RefineOptions(steps=args.steps, lr=args.lr),
            progress=False,
            force=True,
            check=False,
        ).refine
        rounds.append(
            {
                "calibration_s": round(calibration[0], 2),
                "calibration_cpu_s": round(calibration[1], 2),
                "refine_s": record["wall_s"],
                "refine_cpu_s": record["cpu_s"],
                "ratio_wall": round(record["wall_s"] / calibration[0], 2),
                "ratio_cpu": round(record["cpu_s"] / calibration[1], 2),
                "load_average": os.getloadavg(),
            }
        )
        print(json.dumps(rounds[-1]), flush=True)
    medians = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("calibration_s", "calibration_cpu_s", "refine_s", "refine_cpu_s", "ratio_wall", "ratio_cpu")
    }
    return {
        "model": str(source),
        "kv_heads": args.kv[0],
        "method": args.methods[0],
        "calibration_tokens": args.calibration_tokens,
        "rounds": rounds,
        "medians": medians,
    }


def add_gaps(rows: list[dict], parent: float, method_key: str = "method") -> None:
    for row in rows:
        mean = next(
            (
                r["perplexity"]
                for r in rows
                if r["kv_heads"] == row["kv_heads"] and r[method_key] == "mean" and r["refine"] in (False, "merge")
            ),
            None,
        )
        row["gap_closed"] = gap_closed(row["perplexity"], mean, parent) if mean and mean > parent else None


def table(result: dict) -> str:
    lines = [
        f"parent: {result['parent_perplexity']:.2f}; calibration {result['calibration_s']:.1f} s wall, "
        f"{result['calibration_cpu_s']:.1f} s CPU ({result['calibration_tokens']} tokens)",
        "",
        "| kv heads | method | refine | ppl | gap closed | held-out err before -> after | convert s | refine s "
        "| refine / calibration, wall | refine / calibration, CPU | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        gap = "" if row.get("gap_closed") is None else f"{row['gap_closed']:.3f}"
        errors = (
            f"{row['heldout_error_before']:.4f} -> {row['heldout_error_after']:.4f}"
            if "heldout_error_after" in row
            else ""
        )
        refine_s = row.get("refine_s")
        ratio = f"{refine_s / result['calibration_s']:.2f}" if refine_s else ""
        cpu_ratio = f"{row['refine_cpu_s'] / result['calibration_cpu_s']:.2f}" if row.get("refine_cpu_s") else ""
        lines.append(
            f"| {row['kv_heads']} | {row['method']} | {row['refine']} | {row['perplexity']:.2f} | {gap} | "
            f"{errors} | {row['convert_s']} | {refine_s or ''} | {ratio} | {cpu_ratio} | "
            f"{row.get('peak_rss_mib', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    from mha2gqa.files import embedded

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(embedded.model_dir()), help="MHA source model directory")
    parser.add_argument("--kv", default="4,2,1", help="target kv-head counts, comma-separated")
    parser.add_argument("--methods", default="mean,calibrated", help="merge methods, comma-separated")
    parser.add_argument("--calibration", default="austen", help="calibration data (as convert --calibration)")
    parser.add_argument("--calibration-tokens", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=50, help="--refine-steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="--refine-lr")
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--explore", action="store_true", help="compare refine settings (EXPLORE) in-process")
    parser.add_argument("--settings", default=",".join(EXPLORE), help="--explore settings, comma-separated")
    parser.add_argument(
        "--timing",
        type=int,
        default=0,
        metavar="R",
        help="only time R rounds of calibration vs --refine (first --kv and --methods), side by side",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: kv 2, 2048 tokens, 3 steps")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.smoke:
        args.kv, args.calibration_tokens, args.eval_tokens, args.steps = "2", 2048, 2048, 3
    args.kv = [int(k) for k in str(args.kv).split(",")]
    args.methods, args.settings = args.methods.split(","), args.settings.split(",")
    source = Path(args.model)
    if args.timing:
        with tempfile.TemporaryDirectory(prefix="refine-bench-") as work:
            result = run_timing(args, source, Path(work))
        print("medians:", json.dumps(result["medians"]))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return
    from mha2gqa.architecture.layouts import read_config

    context = min(args.context, read_config(source).get("max_position_embeddings") or args.context)
    ids = heldout_ids(source, None, args.eval_tokens)
    parent = model_perplexity(source, ids, context)
    print(f"parent: ppl {parent:.2f} on {len(ids)} held-out tokens; load {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="refine-bench-") as work:
        if args.explore:
            rows, (calibration_s, calibration_cpu_s) = run_explore(args, source, Path(work), ids, context)
        else:
            calibration_s, calibration_cpu_s = calibration_seconds(args, source)
            print(
                f"calibration alone: {calibration_s:.1f} s wall, {calibration_cpu_s:.1f} s CPU for "
                f"{args.calibration_tokens} tokens",
                flush=True,
            )
            rows = run_grid(args, source, Path(work), ids, context)
    add_gaps(rows, parent)
    result = {
        "model": str(source),
        "parent_perplexity": parent,
        "eval_tokens": len(ids),
        "context": context,
        "calibration": args.calibration,
        "calibration_tokens": args.calibration_tokens,
        "calibration_s": round(calibration_s, 2),
        "calibration_cpu_s": round(calibration_cpu_s, 2),
        "steps": args.steps,
        "lr": args.lr,
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
