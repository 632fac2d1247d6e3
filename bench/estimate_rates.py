"""Re-make the rates of mha2gqa's estimates (mha2gqa/data/estimate_rates.json).

The real commands run at two sizes or more, on the embedded model and on SmolLM2-135M (--large), each as its own
process run through bench/_timed.py: every command's clock appends each stage's measured seconds and its work
(tokens x parameters, bytes, ...). Each kind of stage is then fitted as fixed seconds plus a rate per unit of each
work term that varies in its samples (least squares): the compute kinds per model (the rate of a 6M-parameter
model is not a 135M one's; estimates interpolate between the two), the start, load and write kinds jointly over
both models (one fixed part and one rate per byte). A stage of several kinds (uptraining's steps, its evals and a
teacher's forwards) is fitted once its other kinds are. The probe's time goes beside the rates: a run divides its
own probe by it to scale every rate to its machine at the moment.

    flock -x /work/locks/cpu python bench/estimate_rates.py --large /work/runs/smollm2   # on a quiet machine
    python bench/estimate_rates.py --smoke --out /tmp/rates.json                         # toy sizes, no measurement

Writes the rates (--out, default the package's file) and, beside it, every stage record it fitted from
(bench/results/estimates/rates-runs.jsonl by default).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mha2gqa.files import jsontext

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "mha2gqa" / "data" / "austen-mha"
OUT = ROOT / "mha2gqa" / "data" / "estimate_rates.json"
TIMED = Path(__file__).resolve().parent / "_timed.py"  # runs a command with an observer on its clock
RUNS = ROOT / "bench" / "results" / "estimates" / "rates-runs.jsonl"
# Kinds fitted over both models at once (their work is bytes or nothing: a rate per byte does not depend on the
# model's shape); every other kind is fitted per model.
JOINT = {"torch_start", "numpy_start", "eval_load", "convert_load", "uptrain_load", "write_numpy", "write_torch"}
JOINT |= {"metadata", "uptrain_save", "eval_kv", "report", "eval_tally"}
# Terms priced as a fixed share of another term of their kind, not fitted: the global stage's held-out checks (token
# forwards of one model) at a quarter of a fit step's token (a parent forward, a converted forward and its backward,
# ~4 forwards). The bench's short runs check too few held-out tokens to fit them apart; on SmolLM2's default a check
# took ~60 s beside ~27 s a step (2 cores), which the quarter prices at 66 s.
DERIVED = {"refine_global": {"checks": ("steps", 0.25)}}


# --only: which of commands() a subset runs again (its records replace the earlier ones); "check" runs
# check_commands, and its records add the check's parts that earlier runs lacked
SUBSETS = {
    "check": lambda command: False,
    "eval": lambda command: command[0] == "eval" and "--lm-eval-tasks" not in command,
    "probe": lambda command: False,  # no command: the probe's seconds measured again (its design changed)
    "sample": lambda command: "parent" in command,  # the conversions calibrated on the parent's samples
}


def check_commands(model: Path, large: bool, work: Path) -> list[list[str]]:
    """convert's quality check, cold and warm: the first conversion scores the parent (the bench's cache starts
    empty), the next reads its numbers from the cache, the third runs with torch already started (calibrated)."""
    convert = ["convert", str(model), str(work / "out"), "-g", "1" if large else "2", "--force", "-q"]
    calibrated = [*convert, "--method", "calibrated", "--calibration", "austen", "--calibration-tokens", "1024"]
    return [convert, convert, calibrated]


def commands(model: Path, large: bool, smoke: bool, work: Path) -> list[list[str]]:
    """The runs of one model: each a `mha2gqa` command line (without the program), the check's first."""
    m, out = str(model), str(work / "out")
    size = (lambda small, big: small) if not large else (lambda small, big: big)  # noqa: E731
    tokens = [64, 192] if smoke else size([2048, 8192], [1024, 3072])
    calibration = [1024, 2048] if smoke else size([8192, 32768], [4096, 16384])
    # drawn from the parent: one batch, then more (a batch's forwards cost about the same whatever its size)
    sampled = [64, 128] if smoke else size([1024, 3072, 16384], [256, 768, 8192])
    steps = [1, 3] if smoke else size([4, 12], [2, 6])
    groups = "1" if large else "2"
    convert = ["convert", m, out, "-g", groups, "--force", "-q"]
    calibrated = [*convert, "--method", "calibrated", "--calibration", "austen"]
    refine = [*calibrated, "--calibration-tokens", str(calibration[0]), "--refine"]
    runs = check_commands(model, large, work)
    runs += [
        ["eval", m, "--max-tokens", str(n), "--speed", "off", "-q", "--out", f"{out}.json", "--force"] for n in tokens
    ]
    runs.append(["eval", m, "--reference", m, "--max-tokens", str(tokens[0]), "--speed", "cpu", "-q", "--out", f"{out}.json", "--force"])  # fmt: skip
    runs += [[*calibrated, "--calibration-tokens", str(n)] for n in calibration]
    runs += [
        [*convert, "--method", "calibrated", "--calibration", "parent", "--calibration-tokens", str(n)] for n in sampled
    ]
    runs += [[*refine, "--refine-steps", str(n), "--refine-global-steps", "0"] for n in steps]
    runs.append([*refine, "--refine-steps", str(steps[0]), "--refine-global-steps", "0", "--refine-tokens", str(calibration[0] // 2)])  # fmt: skip
    runs += [[*refine, "--refine-steps", str(steps[0]), "--refine-global-steps", str(n)] for n in steps]
    recipe = ROOT / ("recipes/smollm2-distill-cpu.yaml" if large else "mha2gqa/demo/demo-uptrain.yaml")
    data = [] if large else [f"data.train=[{','.join(str(p) for p in sorted((ROOT / 'mha2gqa/data/austen').glob('[!p]*.txt.gz')))}]"]  # fmt: skip
    data += [f"data.eval={ROOT / 'mha2gqa/data/austen/persuasion.txt.gz'}"]
    teacher = [f"distill.teacher={m}"] if large else []
    unset = [] if large else ["budget.alpha=null"]  # the demo's recipe budgets by alpha: steps replace it
    for n in steps:
        runs.append(["uptrain", "--recipe", str(recipe), f"model={m}", f"output_dir={work / 'up'}", "overwrite=true",
                     f"budget.max_steps={n}", *unset, "eval_every=1000", *data, *teacher])  # fmt: skip
    if not large and _installed("lm_eval"):
        for n in (10, 10 if smoke else 40):
            runs.append(["eval", m, "--lm-eval-tasks", "persuasion_cloze", "--lm-eval-limit", str(n), "--speed", "off",
                         "--data", str(ROOT / "mha2gqa/data/austen/persuasion.txt.gz"), "--max-tokens", "512", "-q",
                         "--out", f"{out}.json", "--force"])  # fmt: skip
    if not large:
        runs.append(["demo", "--quick", "--out", str(work / "demo"), "--force"])
    return runs


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def run(command: list[str], timings: Path) -> float:
    """One command as its own process, timed; its clock appends to `timings` (whatever rates its estimate used:
    the records hold the measured seconds and the work, not the estimate)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["MHA2GQA_CACHE"] = str(timings.parent / "cache")  # empty at first: the first check of each model is cold
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(TIMED), str(timings), *command], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"failed: mha2gqa {' '.join(command)}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


# ---- the fit ----


def _unknown(stage: dict, fitted: dict) -> set[str]:
    return {part["kind"] for part in stage["parts"]} - set(fitted)


def _known_seconds(stage: dict, fitted: dict) -> float:
    """The stage's seconds from the parts whose kinds are fitted already."""
    total = 0.0
    for part in stage["parts"]:
        if part["kind"] in fitted:
            total += _seconds(fitted[part["kind"]], part)
    return total


def _seconds(fit: dict, part: dict) -> float:
    key = "joint" if "joint" in fit else str(part["parameters"])
    if key not in fit:  # a model this kind was not fitted on: the nearest one
        key = min((k for k in fit), key=lambda k: abs(np.log(int(k) / part["parameters"])))
    entry = fit[key]
    return (0.0 if part.get("warm") else entry["fixed"]) + sum(
        amount * entry["per"].get(term, 0.0) for term, amount in part["work"].items()
    )


def least_squares(samples: list[tuple[dict, float]]) -> dict:
    """fixed + sum(rate x work) over samples of (work terms, seconds); a term that does not vary across the samples
    folds into the fixed part; negative rates are dropped and the rest refitted."""
    terms = sorted({t for work, _ in samples for t in work if len({w.get(t, 0) for w, _ in samples}) > 1})
    while True:
        rows = np.array([[1.0] + [work.get(t, 0.0) for t in terms] for work, _ in samples])
        target = np.array([seconds for _, seconds in samples])
        scale = np.maximum(np.abs(rows).max(axis=0), 1e-30)
        solution = np.linalg.lstsq(rows / scale, target, rcond=None)[0] / scale
        negative = [t for t, r in zip(terms, solution[1:]) if r < 0]
        if not negative:
            fixed = max(0.0, float(solution[0]))
            return {"fixed": fixed, "per": {t: float(r) for t, r in zip(terms, solution[1:])}}
        terms = [t for t in terms if t not in negative]


def fit(records: list[dict]) -> dict:
    """{kind: {"joint" | parameters: {"fixed", "per"}}} from every run's stages, kinds of one unknown first."""
    stages = [stage for record in records for stage in record["stages"] if stage["parts"]]
    fitted: dict = {}
    while True:
        ready = {}
        for stage in stages:
            unknown = _unknown(stage, fitted)
            if len(unknown) == 1:
                ready.setdefault(unknown.pop(), []).append(stage)
        if not ready:
            return fitted
        for kind, found in ready.items():
            groups: dict = {}
            for stage in found:
                part = next(p for p in stage["parts"] if p["kind"] == kind)
                key = "joint" if kind in JOINT else str(part["parameters"])
                work = _folded(kind, part["work"])
                groups.setdefault(key, []).append((work, stage["seconds"] - _known_seconds(stage, fitted)))
            fitted[kind] = {key: _unfolded(kind, least_squares(samples)) for key, samples in groups.items()}


def _folded(kind: str, work: dict) -> dict:
    """`work` with each DERIVED term added into the term it is priced by, at its share."""
    work = dict(work)
    for term, (base, share) in DERIVED.get(kind, {}).items():
        if term in work:
            work[base] = work.get(base, 0) + share * work.pop(term)
    return work


def _unfolded(kind: str, found: dict) -> dict:
    """The fit with each DERIVED term's rate set from its base term's."""
    for term, (base, share) in DERIVED.get(kind, {}).items():
        found["per"][term] = share * found["per"].get(base, 0.0)
    return found


def rates_file(fitted: dict, small: int, large: int | None, probes: dict, measured: dict) -> dict:
    """The package's format: per kind, (at SMALL, at LARGE) of the fixed seconds and of each term's rate."""
    kinds = {}
    for kind, fits in fitted.items():
        at = [fits.get("joint") or fits.get(str(small)), fits.get("joint") or (fits.get(str(large)) if large else None)]
        if at[0] is None:
            at = [at[1], at[1]]
        terms = sorted({t for f in at if f for t in f["per"]})
        kinds[kind] = {
            "fixed": [f["fixed"] if f else None for f in at],
            "per": {t: [(f["per"].get(t, 0.0) if f else None) for f in at] for t in terms},
        }
    return {"kinds": kinds, "probe_s": probes, "measured": measured}


def probes() -> dict:
    """The probes on this machine now, with torch's own threads (what a command on a quiet machine uses)."""
    from mha2gqa.estimates.rates import probe_seconds

    return {kind: probe_seconds(kind) for kind in ("torch", "numpy", "torch_fine")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large", type=Path, help="SmolLM2-135M's folder (the second model the rates are fitted on)")
    parser.add_argument("--out", type=Path, default=OUT, help="the rates file to write")
    parser.add_argument("--runs", type=Path, default=RUNS, help="every stage record, as JSON lines")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the embedded model: no measurement")
    parser.add_argument(
        "--only",
        choices=sorted(SUBSETS),
        help="run only these commands (check: convert's check cold and warm; eval: eval's runs; sample: the "
        "conversions calibrated on the parent's samples; probe: none, the probe measured again), put their records in --runs in place of the earlier ones of the same commands, "
        "and refit every kind from them all",
    )
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    found = probes()
    records = []
    with tempfile.TemporaryDirectory(prefix="estimate-rates-") as tmp:
        work, timings = Path(tmp), Path(tmp) / "timings.jsonl"
        models = [(EMBEDDED, False)] + ([(args.large, True)] if args.large and not args.smoke else [])
        for model, large in models:
            chosen = commands(model, large, args.smoke, work)
            if args.only:
                chosen = (
                    check_commands(model, large, work)
                    if args.only == "check"
                    else list(filter(SUBSETS[args.only], chosen))
                )
            for command in chosen:
                wall = run(command, timings)
                print(f"{wall:7.1f} s  mha2gqa {' '.join(command)}", flush=True)
        records = [json.loads(line) for line in timings.read_text().splitlines()] if timings.exists() else []
    load.append(os.getloadavg()[0])
    found = {kind: min(seconds, probes()[kind]) for kind, seconds in found.items()}  # before and after: the quieter
    measured_before = {}
    if args.only:  # the earlier records and their probe stay, less those these runs measured again
        earlier = json.loads(args.out.read_text())
        measured_before = earlier["measured"]
        found = found if args.only == "probe" else earlier["probe_s"]
        kept = [json.loads(line) for line in args.runs.read_text().splitlines()]
        records = [r for r in kept if not SUBSETS[args.only](r["command"][1:])] + records
    from mha2gqa.estimates.rates import LARGE, SMALL

    measured = {
        "date": dt.date.today().isoformat(),
        "cores": os.cpu_count(),
        "load": max(load),
        "load_before_after": load,
        "threads": records[0]["threads"] if records else None,
        "command": "python bench/estimate_rates.py"
        + (f" --large {args.large}" if args.large else "")
        + (f" --only {args.only}" if args.only else ""),
        "smoke": args.smoke,
    }
    if args.only:
        measured = {**measured_before, f"{args.only}_measured_again": measured}
    result = rates_file(fit(records), SMALL, LARGE if args.large else None, found, measured)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(jsontext.dumps(result, indent=1) + "\n")
    args.runs.parent.mkdir(parents=True, exist_ok=True)
    args.runs.write_text("".join(jsontext.dumps(r) + "\n" for r in records))
    print(f"wrote {args.out} ({len(result['kinds'])} kinds, load {load[0]:.2f} -> {load[1]:.2f}) and {args.runs}")


if __name__ == "__main__":
    main()
