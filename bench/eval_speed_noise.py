"""Decode-speed noise: how much `mha2gqa eval --speed cpu` varies from run to run on this machine, and
whether the report claims a speed-up only where the spread allows one.

The embedded parent (8 kv heads) and its mean-pooled GQA-2 conversion are measured in alternating
rounds (ABAB, so a change of machine load hits both), each round as `eval --speed cpu` would; every
round's pair goes through `write_report`, and the table shows per round each model's median tokens/s
with its interquartile range, the timed repeats taken, the seconds the whole eval took (model load, KV
measurement, the speed grid: what the time budget bounds), and the report's speed-up with its range and
noise mark.

Run:       python bench/eval_speed_noise.py --rounds 3      (about a minute on a quiet 2-core machine)
Smoke run: python bench/eval_speed_noise.py --smoke         (one round, a one-point grid: seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import mha2gqa
from mha2gqa.files import embedded
from mha2gqa.report import write_report


def measure(model, label: str, speed: dict, out: Path) -> tuple[dict, float]:
    started = time.perf_counter()
    result = mha2gqa.evaluate(str(model), label=label, speed_preset="cpu", progress=False, out=out, **speed)
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one round on a one-point grid (a test runs it)")
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    speed = dict(speed_batches=(1,), speed_contexts=(8,), new_tokens=2) if args.smoke else {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gqa = work / "gqa2"
        mha2gqa.convert(embedded.model_dir(), gqa, groups=2, progress=False, check=False)
        print(
            "| round | model | tok/s median (IQR) | repeats | eval s (load, KV, speed) | speed-up (range) | report says |",
            "|---|---|---|---|---|---|---|",
            sep="\n",
        )
        for n in range(1, rounds + 1):
            paths = []
            for model, label in ((embedded.model_dir(), "parent"), (gqa, "gqa2")):
                paths.append(work / f"{label}-{n}.json")
                result, seconds = measure(model, label, speed, paths[-1])
                point = result["speed"]["points"][-1]
                low, high = point["tokens_per_s_iqr"]
                print(
                    f"| {n} | {label} | {point['tokens_per_s']:,.1f} ({low:,.1f}-{high:,.1f}) | {point['repeats']} "
                    f"| {seconds:.1f} | | |"
                )
            # Timed apart on purpose (how much such a ratio moves is what this measures): --speedup-apart.
            report = write_report(paths, work / f"report-{n}", speedup_apart=True)
            row = json.loads(report["json"].read_text())["rows"][1]
            low, high = row["speedup_range"]
            verdict = "noise" if row["speedup_noisy"] else "faster" if row["speedup"] > 1 else "slower"
            print(f"| {n} | gqa2 / parent | | | | {row['speedup']:.2f}x ({low:.2f}-{high:.2f}) | {verdict} |")
    load_after = os.getloadavg()
    print(
        f"\nload average (1 min) {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end; {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
