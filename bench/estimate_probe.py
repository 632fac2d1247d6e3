"""How well a short probe predicts the speed of sustained work on this machine, quiet and shared: the choice of
the probe behind every estimate (mha2gqa/estimates/rates.py).

Each run is a fresh process (a command's probe runs as its process starts): it times rounds of the probe (after
the warm-up rounds a command runs too), then a long stretch of the same work, with N processes spinning on a core
each beside it. For each way of summing up the rounds (their median, their fastest, the first few...) the table
gives the log of (work per round / the statistic) by N, and its spread over every run: the statistic wanted has
a small spread and about the same mean at every N (a bias the same quiet and busy cancels against the rates
file's probe, which is measured the same way). Then each run's statistics as the factor they would scale the
rates by (over the rates file's probe), to set beside the commands' own slow-down in bench/estimate_check.py.

    python bench/estimate_probe.py --repeats 3 --busy 0 1 2 3 --out bench/results/estimates/probe.json
    python bench/estimate_probe.py --threads 1 --repeats 10 --busy 2          # the factors at one thread, busy
    python bench/estimate_probe.py --probe torch_fine --repeats 3 --busy 0 2  # refine's small products
    python bench/estimate_probe.py --smoke      # one toy run: no measurement
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mha2gqa.estimates import rates
from mha2gqa.files import jsontext

SPIN = "while True: pass"
CHILD = """
import json, sys, time
import torch
from mha2gqa.estimates import rates
rounds, work_rounds, threads, probe = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), rates.PROBES[sys.argv[4]]
if threads:
    torch.set_num_threads(threads)
for _ in range(rates.PROBE_WARMUP):
    probe()
timed = [probe() for _ in range(rounds)]
started = time.perf_counter()
for _ in range(work_rounds):
    probe()
print(json.dumps({"rounds": timed, "work_per_round": (time.perf_counter() - started) / work_rounds}))
"""
STATISTICS = {
    "fastest of 11 (shipped, several threads)": lambda r: min(r[: rates.PROBE_ROUNDS]),
    "median of 11 (shipped, small products)": lambda r: statistics.median(r[: rates.PROBE_ROUNDS]),
    "geometric mean of fastest and median of 11 (shipped, one thread)": lambda r: math.sqrt(
        min(r[: rates.PROBE_ROUNDS]) * statistics.median(r[: rates.PROBE_ROUNDS])
    ),
    "fastest of all": min,
    "2nd fastest of 11": lambda r: sorted(r[: rates.PROBE_ROUNDS])[1],
    "median of all": statistics.median,
    "median of the first 5": lambda r: statistics.median(r[:5]),
    "mean of all": statistics.mean,
}


def one_run(spinners: int, rounds: int, work_rounds: int, threads: int = 0, probe: str = "torch") -> dict:
    spinning = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(spinners)]
    try:
        time.sleep(2 if spinners else 0)  # the spinners running before the probe starts
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(rounds), str(work_rounds), str(threads), probe],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        for process in spinning:
            process.kill()
            process.wait()
    return {
        "spinners": spinners,
        "threads": threads,
        "probe": probe,
        **json.loads(done.stdout.strip().splitlines()[-1]),
    }


def table(runs: list[dict]) -> list[str]:
    counts = sorted({r["spinners"] for r in runs})
    lines = ["| statistic | spread (s.d. of log) | " + " | ".join(f"mean log at {n} busy" for n in counts) + " |"]
    lines.append("|---|---:|" + "---:|" * len(counts))
    for name, statistic in STATISTICS.items():
        logs = [math.log(r["work_per_round"] / statistic(r["rounds"])) for r in runs]
        spread = statistics.stdev(logs) if len(logs) > 1 else 0.0
        by = [statistics.mean(x for x, r in zip(logs, runs) if r["spinners"] == n) for n in counts]
        lines.append(f"| {name} | {spread:.2f} | " + " | ".join(f"{b:.2f}" for b in by) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2, 3], help="spinning processes, per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default, one a core); mha2gqa runs a small model on a busy machine with one",
    )
    parser.add_argument("--probe", choices=sorted(rates.PROBES), default="torch", help="which of rates.PROBES")
    parser.add_argument("--out", type=Path, help="write every run as JSON")
    parser.add_argument("--smoke", action="store_true", help="one toy run: no measurement")
    args = parser.parse_args()
    rounds, work_rounds = (rates.PROBE_ROUNDS, 4) if args.smoke else (15, 80)
    busy, repeats = ([0], 1) if args.smoke else (args.busy, args.repeats)
    runs = []
    for _ in range(repeats):  # the spinner counts interleaved: the machine's own drift falls on each alike
        for spinners in busy:
            runs.append(one_run(spinners, rounds, work_rounds, args.threads, args.probe))
            print(f"{spinners} busy: work {1000 * runs[-1]['work_per_round']:.0f} ms a round", flush=True)
    print("\n".join(table(runs)))
    measured = rates.load().probe_s[args.probe]
    for r in runs:  # what each statistic would scale the rates by: compare with the commands' own slow-down
        factors = ", ".join(
            f"{name} x{statistic(r['rounds']) / measured:.2f}" for name, statistic in STATISTICS.items()
        )
        print(f"{r['spinners']} busy, factor of the rates file's probe: {factors}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(jsontext.dumps({"runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
