"""How close each long command's estimate comes to its wall time, on a quiet machine and on a busy one: the table of
docs/benchmarks.md ("Estimates").

Each command is a real run, as its own process: the first estimate it prints (before any work), the remaining time
it corrects to after its first stage, what it says it took, and its wall time as measured from outside, with the
load average before and after. --busy N adds N processes that spin on a core each for the whole check (the
machine shared with other work), started a minute before the first command so that the load average has risen.

    flock -x /work/locks/cpu python bench/estimate_check.py --large /work/runs/smollm2 --work /tmp/ec
    flock -x /work/locks/cpu python bench/estimate_check.py --large /work/runs/smollm2 --work /tmp/ec --busy 2
    python bench/estimate_check.py --smoke --work /tmp/ec                  # toy sizes: no measurement

Prints one markdown row a command and writes every row as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mha2gqa.files import jsontext

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "mha2gqa" / "data" / "austen-mha"
TIMED = Path(__file__).resolve().parent / "_timed.py"  # runs a command with an observer on its clock
SPIN = "while True: pass"


def commands(large: Path | None, work: Path, smoke: bool) -> list[tuple[str, list[str]]]:
    """(name, mha2gqa arguments) of every command the table times, at sizes that keep each a real run."""
    e = str(EMBEDDED)
    big = str(large) if large and not smoke else e
    groups = "1" if large and not smoke else "2"
    tokens = "256" if smoke else "32768"
    found = [
        ("demo --quick", ["demo", "--quick", "--out", str(work / "demo"), "--force"]),
        ("convert, mean", ["convert", big, str(work / "mean"), "-g", groups, "--force"]),
        ("convert, calibrated", ["convert", big, str(work / "cal"), "-g", groups, "--method", "calibrated",
                                 "--calibration", "austen", "--calibration-tokens", tokens, "--force"]),
        ("convert, calibrated + refine", ["convert", e, str(work / "ref"), "-g", "2", "--method", "calibrated",
                                          "--calibration", "austen", "--refine", "--force"]
         + (["--calibration-tokens", "2048", "--refine-steps", "2", "--refine-global-steps", "2"] if smoke else [])),
        ("sweep", ["sweep", e, "--calibration", "austen", "--groups", "4,2", "--methods", "mean,calibrated",
                   "--out", str(work / "sweep"), "--force"] + (["--max-tokens", "128", "--calibration-tokens", "2048"] if smoke else [])),
        ("eval, with --reference", ["eval", str(work / "mean"), "--reference", big, "--out", str(work / "eval.json"),
                                    "--force"] + (["--max-tokens", "128"] if smoke else [])),
        ("uptrain", ["uptrain", "--recipe", str(ROOT / "recipes" / "tiny-cpu.yaml"), f"output_dir={work / 'up'}",
                     "overwrite=true", f"tokenizer={e}"] + (["budget.max_steps=4"] if smoke else [])),
    ]  # fmt: skip
    return found


ESTIMATE = re.compile(r"^estimate: about (\d+) (s|min|h)(?: (\d+) min)?", re.M)
MEMORY = re.compile(r"^estimate: .*?, peak memory about ([\d.]+) ([KMG])iB", re.M)
LEFT = re.compile(r"^(\d+) stages? in .*?: about (\d+) (s|min|h)(?: (\d+) min)? left", re.M)
TOOK = re.compile(r"^took (.*?) \(estimated", re.M)


def seconds(amount: str, unit: str, minutes: str | None = None) -> float:
    return {"s": 1, "min": 60, "h": 3600}[unit] * int(amount) + 60 * int(minutes or 0)


def settle(limit_s: float = 150.0, quiet: float = 0.8) -> None:
    """Wait (at most `limit_s`) until the 1-minute load average falls below `quiet`: the previous command's own
    threads linger in it for a minute or two, and a command that starts then sees a busy machine (it takes one
    thread, and its probe says so), which a user on a quiet machine never does."""
    waited = 0.0
    while os.getloadavg()[0] >= quiet and waited < limit_s:
        time.sleep(5)
        waited += 5


def measure(name: str, command: list[str], cwd: Path) -> dict:
    """One command, timed from outside; what it said about its time, read from its output."""
    # The previous command's writes (a 500 MB checkpoint) flushed first: the kernel's writeback beside the next
    # command's probe read 2.7-3.3x where 2.3-2.7x after a sync, two spinners beside (a user starts the next command
    # after reading the last one's output, not within the same second).
    os.sync()
    load = os.getloadavg()[0]
    timings = cwd / f".timings-{os.getpid()}.jsonl"
    timings.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    rss = cwd / f".peak-{os.getpid()}"
    timed = ["/usr/bin/time", "-o", str(rss), "-f", "%M"] if Path("/usr/bin/time").exists() else []
    started = time.perf_counter()
    done = subprocess.run([*timed, sys.executable, str(TIMED), str(timings), *command], cwd=cwd, env=env, capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - started
    peak = int(rss.read_text().split()[-1]) * 1024 if timed and rss.exists() else None
    rss.unlink(missing_ok=True)
    text = done.stdout + "\n" + done.stderr.replace("\r", "\n")
    if done.returncode != 0:
        raise SystemExit(f"failed: mha2gqa {' '.join(command)}\n{done.stderr[-3000:]}")
    first = ESTIMATE.search(text)
    left = LEFT.search(text)
    took = TOOK.search(text)
    record = json.loads(timings.read_text().splitlines()[-1]) if timings.exists() else {}
    timings.unlink(missing_ok=True)
    estimate = record.get("estimate_s") or (seconds(*first.groups()) if first else None)  # unrounded, from the clock
    return {
        "name": name,
        "command": "mha2gqa " + " ".join(command),
        "estimate_s": estimate,
        "estimate_line": first.group(0) if first else None,
        "peak_estimate_bytes": _bytes(MEMORY.search(text)),
        "corrected_left_s": seconds(*left.groups()[1:]) if left else None,
        "took_line": took.group(1) if took else None,
        "stages": record.get("stages"),
        "factor": record.get("factor"),
        "fine_factor": record.get("fine_factor"),
        "threads": record.get("threads"),
        "wall_s": round(wall, 1),
        "peak_rss_bytes": peak,
        "ratio": round(estimate / wall, 2) if estimate else None,
        "load_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def _bytes(found) -> int | None:
    return int(float(found.group(1)) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[found.group(2)]) if found else None


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f} GiB"


def row(r: dict) -> str:
    ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
    within = "yes" if r["ratio"] and 0.7 <= r["ratio"] <= 1.3 else "no"
    load = "-".join(f"{x:.1f}" for x in r["load_before_after"])
    memory = f"{_gib(r['peak_estimate_bytes'])} / {_gib(r['peak_rss_bytes'])}"
    return f"| {r['name']} | {r['estimate_s']:.0f} s | {r['wall_s']:.0f} s | {ratio} | {within} | {memory} | {load} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large", type=Path, help="SmolLM2-135M's folder (convert and eval run on it)")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (emptied first)")
    parser.add_argument("--busy", type=int, default=0, help="processes that spin on a core each during the check")
    parser.add_argument("--only", nargs="*", help="names of the commands to run (default: all)")
    parser.add_argument("--out", type=Path, help="write the rows here as JSON")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the embedded model: no measurement")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
    try:
        if spinners and not args.smoke:
            time.sleep(60)  # the 1-minute load average rises to the spinners
        rows = []
        print(
            "| command | estimate | wall | estimate / wall | within 30% | peak memory, estimate / RSS | load before-after |"
        )
        print("|---|---:|---:|---:|---|---|---|")
        for name, command in commands(args.large, args.work, args.smoke):
            if args.only and name not in args.only:
                continue
            if not args.busy and not args.smoke:
                settle()
            rows.append(measure(name, command, ROOT))
            print(row(rows[-1]), flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(jsontext.dumps({"busy": args.busy, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
