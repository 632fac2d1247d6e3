"""How long the `mha2gqa` command takes to answer, side by side with a bare `python -c pass`.

    python bench/cli_startup.py                     # 7 interleaved rounds, medians
    python bench/cli_startup.py --repeats 15
    python bench/cli_startup.py --before /tmp/old   # and an older checkout in the same rounds
    python bench/cli_startup.py --smoke             # one round of the cheap commands (run by a test)

Every command is its own process, started the way the console script starts (`python -m mha2gqa`),
in rounds that interleave the commands so a busy machine slows them alike. The table shows each
command's median wall time, that minus the bare Python start, and the goals of issue 14:
`--help` within 0.3 s of a bare start, `inspect` (config only) within 1 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_MODEL = ROOT / "mha2gqa" / "data" / "austen-mha"
# name -> (arguments after `python`, goal in seconds over the bare start or absolute, or None)
COMMANDS = {
    "python -c pass": (["-c", "pass"], None),
    "mha2gqa --help": (["-m", "mha2gqa", "--help"], ("over bare start", 0.3)),
    "mha2gqa convert --help": (["-m", "mha2gqa", "convert", "--help"], ("over bare start", 0.3)),
    "mha2gqa inspect EMBEDDED": (["-m", "mha2gqa", "inspect", str(EMBEDDED_MODEL)], ("total", 1.0)),
}
SMOKE = ("python -c pass", "mha2gqa --help")


def time_once(args: list[str], env: dict, cwd: Path) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} in {cwd} exited {done.returncode}:\n{done.stderr}")
    return elapsed


def checkout_env(root: Path) -> dict:
    """`python -m` puts the working directory first on sys.path; PYTHONPATH covers the rest."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def measure(names: list[str], roots: list[Path], repeats: int) -> dict[tuple[Path, str], list[float]]:
    jobs = [(root, name) for name in names for root in roots]
    times = {job: [] for job in jobs}
    envs = {root: checkout_env(root) for root in roots}
    for round_ in range(repeats + 1):  # round 0 warms the page cache and is not counted
        for root, name in jobs if round_ % 2 else jobs[::-1]:
            elapsed = time_once(COMMANDS[name][0], envs[root], root)
            if round_:
                times[root, name].append(elapsed)
    return times


def table(times: dict[tuple[Path, str], list[float]], root: Path) -> list[str]:
    bare = statistics.median(times[root, "python -c pass"])
    lines = [f"{'command':<26} {'median s':>9} {'minus bare':>11} {'min s':>7} {'max s':>7}  goal", "-" * 80]
    for (where, name), values in times.items():
        if where != root:
            continue
        median = statistics.median(values)
        verdict = ""
        if COMMANDS[name][1]:
            kind, limit = COMMANDS[name][1]
            value = median - bare if kind == "over bare start" else median
            verdict = f"<= {limit:g} s {kind}: {'met' if value <= limit else 'MISSED'} ({value:.2f} s)"
        lines.append(
            f"{name:<26} {median:>9.3f} {median - bare:>11.3f} {min(values):>7.3f} {max(values):>7.3f}  {verdict}"
        )
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="counted rounds (after one warm-up round)")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the checkout whose mha2gqa to time (default: this one)"
    )
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="another checkout (e.g. `git archive OLD | tar -x -C DIR`), timed in the same rounds",
    )
    parser.add_argument("--smoke", action="store_true", help="one round of the two cheapest commands")
    args = parser.parse_args(argv)
    roots = [args.root.resolve()] + ([args.before.resolve()] if args.before else [])
    names = list(SMOKE) if args.smoke else list(COMMANDS)
    repeats = 1 if args.smoke else args.repeats
    times = measure(names, roots, repeats)
    print(
        f"{repeats} rounds, load average {os.getloadavg()[0]:.2f} at the end, {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}"
    )
    for root in roots:
        print(f"\n{root}")
        print("\n".join(table(times, root)))


if __name__ == "__main__":
    main()
