"""Every GPU check of the toolkit in two device calls, for the times a GPU machine (one H200) is lent.

    python3 bench/gpu_check.py --parts eval_gpu,uptrain_gpu,convert_refine,decode_paths  # on the GPU machine: ~9.5 min
    python3 bench/gpu_check.py --parts fsdp,qlora,recovery                  # the second device call: ~6 min
    python3 bench/gpu_check.py --parts 3,5     # rerun only some parts (numbers or names)
    python3 bench/gpu_check.py --smoke         # the same code at toy sizes on CPU (run by a test)

Until part 6 has measured the real model (issue 36, item 4), a lent session spends its device time on that first:
`python scripts/gpu_smollm2.py split bench/real` prints its four calls (about 700 s with the start; the last is
`RECOVERY_PARENT=/tmp/smollm2 python3 bench/gpu_check.py --parts recovery`), then part 3 if time is left.

Parts, in order, each a pytest module of tests/gpu (marker `gpu`) run in a process of its own under its own time
limit (the estimate printed before it starts); a failure is recorded with its traceback and the later parts still
run. Without CUDA the tests skip, unless --smoke asks for their toy sizes on CPU:
  1 eval_gpu        decode tokens/s of MHA, GQA-8 and MQA at batch 1..64 x context 2048, eager and CUDA graph,
                    peak memory, KV bytes of the live cache vs the formula (bench/eval_gpu.py)
  2 uptrain_gpu     uptrain loop tokens/s and MFU at 1B bf16, and the hand-written loop (bench/uptrain_gpu.py --baseline)
  3 convert_refine  convert --method calibrated --refine of a ~1B Llama-shaped random checkpoint on the
                    embedded calibration text: seconds and peak GPU memory per stage; CUDA vs CPU layer-wise refined weights
  4 fsdp            accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes 1, 5 steps:
                    the final checkpoint loads and equals the trained weights; --resume continues exactly
  5 qlora           trainable: lora with load_in_4bit, 5 steps, merged into a plain checkpoint that loads
  6 recovery        the real model's recovery: bench/recovery_real.py --recipe distill-parent-gpu from the mean and
                    the calibrated + --refine start, ratio to the parent per probe domain at 131k, 262k and 1.05M
                    distillation tokens (the parent: RECOVERY_PARENT, else the embedded model;
                    scripts/gpu_smollm2.py brings SmolLM2 there); how many tokens close the gap. Last, it gets
                    what is left of the budget, and keeps the starts it finished
  7 decode_paths    decode tokens/s of MHA, GQA-8 and MQA at batch 64 x 2048 on every attention path: transformers'
                    default, eval's grouped, static cache, SDPA backends forced, TRANSFORMERS_SDPA_FORCE_GQA=1,
                    FlexAttention, torch.compile; a profile of one step (top kernels), SDPA's priority order
                    (bench/decode_paths_gpu.py). Runs in the first call; paths past its limit are recorded as not reached
Writes gpu_check.json (every number), gpu_check.md (the same as one table) and gpu_check.log (every part's output)
to $OUT, or --out, or .bench/gpu-check.

The GPU machine has its own python3 with torch, transformers, accelerate, peft and pytest (2026-12-04: torch 2.11,
transformers 5.17, peft 0.21.0), but no datasets and no bitsandbytes, and reaches no package registry. Wheels put
in bench/wheels (`python scripts/gpu_wheels.py bench/wheels` prints the commands that fill it, run here; the folder
is git-ignored: name it in the device tool's carry) are installed into a temporary folder before the parts run.
The package itself needs no install: this script puts the repo root on every part's PYTHONPATH.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / "bench" / "wheels"
BUDGET_S = 570  # one device call runs 600 s at most: the wheels' install and Python's start take the rest


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    estimate_s: int  # on one H200
    limit_s: int
    smoke_estimate_s: int  # on a 2-core CPU
    smoke_limit_s: int = 300


PARTS = (  # estimates: the first H200 run, 2026-12-04 (bench/results/gpu/), rounded up
    Part("eval_gpu", "decode tokens/s MHA / GQA-8 / MQA, batch 1-64 x context 2048, eager + CUDA graph", 90, 150, 10),
    # measured: the uptrain loop, then the hand-written one was still running at 150 s (both compile a 1B model)
    Part("uptrain_gpu", "uptrain tokens/s and MFU at 1B bf16, vs the hand-written loop", 200, 260, 15),
    Part(
        "convert_refine",
        "convert --method calibrated --refine of a ~1B model: seconds and memory per stage",
        90,
        150,
        10,
    ),
    Part("fsdp", "accelerate FSDP launch, 5 steps: final checkpoint == trained weights; --resume exact", 70, 120, 20),
    Part("qlora", "trainable: lora + load_in_4bit, 5 steps, merged into a plain checkpoint", 20, 60, 8),
    # measured: the embedded parent's mean start in 180 s, most of it drawing 1.05M tokens of the parent's samples
    Part(
        "recovery", "distill-parent-gpu from two starts: ratio to the parent per domain up to 1M tokens", 270, 540, 90
    ),
    # not run yet: 25 s of start, ~20 s for the 14 eager paths (3 models x 8 steps of <= 40 ms, each cache drawn on
    # the GPU), ~45 s for FlexAttention's 3 compiles and ~90 s for torch.compile's 3 (bench/decode_paths_gpu.py);
    # the compiled paths come last and are left out, recorded, where the limit would not hold them
    Part(
        "decode_paths",
        "decode tokens/s MHA / GQA-8 / MQA at 64 x 2048 on every attention path, one step profiled",
        180,
        235,
        60,
    ),  # fmt: skip
)
# The parts do not fit one device call (600 s): a lent session runs them as these two calls, back to back (the
# machine stays warm between them), each `python3 bench/gpu_check.py --parts ...` with its own $OUT. Recovery
# closes the second call, as it takes what is left of the budget; so part 7 runs in the first.
CALLS = ("eval_gpu,uptrain_gpu,convert_refine,decode_paths", "fsdp,qlora,recovery")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on CPU; what needs CUDA is skipped, with why")
    parser.add_argument(
        "--out", type=Path, help="folder for gpu_check.json/.md/.log (default: $OUT or .bench/gpu-check)"
    )
    parser.add_argument("--parts", help="comma-separated part numbers or names to run (default: all, in order)")
    parser.add_argument(
        "--budget", type=int, default=BUDGET_S, help="seconds for all parts together (not with --smoke)"
    )
    parser.add_argument("--fail", metavar="PART", help="make PART raise at its start (checks the failure recording)")
    args = parser.parse_args(argv)
    try:
        parts = select_parts(args.parts)
        if args.fail and args.fail not in {p.name for p in PARTS}:
            raise ValueError(f"--fail {args.fail}: not a part (one of {', '.join(p.name for p in PARTS)})")
    except ValueError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / ".bench" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        record = run_all(parts, args, Path(tmp), out)
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1))
    (out / "gpu_check.md").write_text(markdown(record))
    print(summary(record))
    print(f"wrote {out / 'gpu_check.json'}, {out / 'gpu_check.md'} and {out / 'gpu_check.log'}")
    return 0 if all(p["status"] == "ok" for p in record["parts"]) else 1


def select_parts(spec: str | None) -> list[Part]:
    if not spec:
        return list(PARTS)
    chosen = []
    for item in spec.split(","):
        item = item.strip()
        match = [p for i, p in enumerate(PARTS, 1) if item in (str(i), p.name)]
        if not match:
            raise ValueError(
                f"--parts {spec}: {item!r} is not a part (1-{len(PARTS)} or {', '.join(p.name for p in PARTS)})"
            )
        chosen += match
    return [p for p in PARTS if p in chosen]  # always in the order of the check


# ---- running the parts ----


def run_all(parts: list[Part], args, tmp: Path, out: Path) -> dict:
    start = time.perf_counter()  # the budget counts the install and the probe too
    site, installed = install_wheels(tmp) if not args.smoke else (None, [])
    env = child_env(site, tmp)
    record = {
        "smoke": args.smoke,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine(env), "installed_from_wheels": installed},
        "budget_s": None if args.smoke else args.budget,
        "parts": [],
    }
    with (out / "gpu_check.log").open("w") as log:
        for index, part in enumerate(parts):
            left = None if args.smoke else args.budget - (time.perf_counter() - start)
            later = sum(p.estimate_s for p in parts[index + 1 :])
            entry = run_part(part, args, env, tmp / part.name, log, left, later)
            record["parts"].append(entry)
    record["total_s"] = round(time.perf_counter() - start, 1)
    return record


def part_limit(part: Part, smoke: bool, left: float | None, later_estimates: int) -> int:
    """The part's own limit, cut so that the later parts' estimates still fit what is left of the budget
    (but not below the part's own estimate), and never past the budget's end."""
    if smoke or left is None:
        return part.smoke_limit_s if smoke else part.limit_s
    return int(min(part.limit_s, max(part.estimate_s, left - later_estimates), left))


def run_part(part: Part, args, env: dict, work: Path, log, left: float | None, later: int) -> dict:
    estimate = part.smoke_estimate_s if args.smoke else part.estimate_s
    limit = part_limit(part, args.smoke, left, later)
    entry = {"name": part.name, "what": part.what, "estimate_s": estimate, "limit_s": limit}
    number = [p.name for p in PARTS].index(part.name) + 1
    if left is not None and left < 10:
        print(f"[{number}] {part.name}: not started, the {args.budget} s budget is spent", flush=True)
        return {**entry, "status": "not run", "error": f"the total budget of {args.budget} s was spent"}
    print(f"[{number}] {part.name}: {part.what} (estimate {estimate} s, limit {limit} s)", flush=True)
    work.mkdir(parents=True)
    result_file = work / "result.json"
    started, cpu = time.perf_counter(), _children_cpu()
    part_env = {**env, "GPU_CHECK_WORK": str(work), "GPU_CHECK_RESULT": str(result_file)}  # read by tests/gpu
    part_env["GPU_CHECK_SMOKE"] = "1" if args.smoke else "0"
    part_env["GPU_CHECK_FAIL"] = part.name if args.fail == part.name else ""
    part_env["GPU_CHECK_LIMIT_S"] = str(limit)  # a part that can stop early and keep what it measured reads it
    returncode, output = run_logged(part_command(part), part_env, limit, log, part.name)
    entry["seconds"] = round(time.perf_counter() - started, 1)
    entry["cpu_s"] = round(_children_cpu() - cpu, 1)  # the part's processes, launcher workers included
    found = json.loads(result_file.read_text()) if result_file.is_file() else {}
    entry["result"] = found.get("result")
    entry["skipped"] = found.get("skipped", [])
    for item in entry["skipped"]:
        print(f"    skipped: {item['what']}: {item['reason']}", flush=True)
    if returncode is None:
        entry.update(status="timed out", error=f"killed after its limit of {limit} s", traceback=tail(output))
    elif returncode != 0 or "result" not in found:
        entry.update(
            status="failed", error=found.get("error") or f"exit code {returncode}", traceback=traceback_of(output)
        )
    else:
        entry["status"] = "ok"
    print(
        f"    {entry['status']} in {entry['seconds']} s" + (f": {entry['error']}" if "error" in entry else ""),
        flush=True,
    )
    return entry


def part_command(part: Part) -> list[str]:
    """pytest on the part's module of tests/gpu; native tracebacks (what the record keeps), and only tests/gpu's
    conftest: the suite's own pins one torch thread for its tiny models, which a GPU part must not inherit."""
    test = ROOT / "tests" / "gpu" / f"test_{part.name}.py"
    return [sys.executable, "-m", "pytest", str(test), "-q", "-s", "--tb=native", "-p", "no:cacheprovider",
            "--confcutdir", str(test.parent), "-m", "gpu"]  # fmt: skip


def run_logged(command: list[str], env: dict, limit: int, log, name: str) -> tuple[int | None, str]:
    """Run `command` in a process group of its own, its output copied to `log` and kept; after `limit`
    seconds the whole group (accelerate's workers too) is ended. Returns (exit code or None, output)."""
    log.write(f"==== {name}: {' '.join(command)}\n")
    log.flush()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []

    def copy():
        for line in process.stdout:
            lines.append(line)
            log.write(line)
        log.flush()

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        returncode = process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        returncode = None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=10)
                break
            except (subprocess.TimeoutExpired, ProcessLookupError):
                continue
    # What the part left running (a bench its test stopped at a timeout) holds the output pipe open: end it,
    # so that the copy sees the pipe's end before the log closes.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    reader.join(timeout=10)
    return returncode, "".join(lines)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def traceback_of(output: str) -> str:
    """From the first Python traceback in `output` to its end: a launcher's child fails first, the part
    then fails on its exit code. The middle of a long one is cut; the output's tail when there is none."""
    at = output.find("Traceback (most recent call last)")
    if at < 0:
        return tail(output)
    found = output[at:]
    return found if len(found) <= 8000 else found[:3000] + "\n[...]\n" + found[-5000:]


def tail(output: str, chars: int = 4000) -> str:
    return output[-chars:]


def child_env(site: Path | None, tmp: Path) -> dict:
    """The parts' environment: the installed wheels and the repo root first on PYTHONPATH, offline hub."""
    env = dict(os.environ)
    paths = [str(p) for p in (site, ROOT) if p] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "datasets-cache"),
        TQDM_DISABLE="1",  # progress bars would fill the log
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def machine(env: dict) -> dict:
    """Python, torch, CUDA, the GPU and the versions of what the parts import, read in a child process
    that sees the same PYTHONPATH as the parts."""
    probe = (
        "import json, importlib.metadata as m, torch\n"
        "def v(n):\n"
        "    try: return m.version(n)\n"
        "    except m.PackageNotFoundError: return None\n"
        "names = ('transformers', 'accelerate', 'peft', 'safetensors', 'datasets', 'bitsandbytes', 'pyarrow', 'fsspec')\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "  'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else None,\n"
        "  'packages': {n: v(n) for n in names}}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    found = json.loads(done.stdout) if done.returncode == 0 else {"probe_error": done.stderr[-500:]}
    return {"python": platform.python_version(), "host": platform.node(), **found}


# ---- wheels for the GPU machine (scripts/gpu_wheels.py fills bench/wheels) ----


def install_wheels(tmp: Path, folder: Path = WHEEL_DIR) -> tuple[Path | None, list[str]]:
    """pip install (no index, no dependencies) the wheels in `folder` unless that version is installed, into
    tmp/site, which goes first on the parts' PYTHONPATH. Returns (the site folder, the wheels installed), or
    (None, []) when there is nothing to do."""
    wanted = [w for w in sorted(folder.glob("*.whl")) if _installed(w.name.split("-")[0]) != w.name.split("-")[1]]
    if not wanted:
        return None, []
    site = tmp / "site"
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--target", str(site), *map(str, wanted)]
    print(f"installing {len(wanted)} wheels from {folder}: {', '.join(w.name for w in wanted)}", flush=True)
    subprocess.run(command, check=True)
    return site, [w.name for w in wanted]


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- the report ----


def numbers(value, prefix: str = ""):
    """(dotted key, value) for every number and flag in a nested result; lists are indexed."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from numbers(item, f"{prefix}[{i}]")
    elif isinstance(value, (bool, int, float)) and value is not None:
        yield prefix, value


def markdown(record: dict) -> str:
    where = record["machine"]
    lines = [
        f"# gpu_check {'(smoke: toy sizes on CPU, no measurement)' if record['smoke'] else ''}".rstrip(),
        "",
        f"{record['started_utc']}, {where.get('gpu') or 'no GPU'}, torch {where.get('torch')}, "
        f"CUDA {where.get('cuda')}, Python {where['python']}; total {record['total_s']} s.",
        "",
        "| part | quantity | value |",
        "|---|---|---:|",
    ]
    for part in record["parts"]:
        lines.append(f"| {part['name']} | status | {part['status']} |")
        for key in ("seconds", "cpu_s", "estimate_s", "limit_s"):  # the harness's, apart from the result's own
            if key in part:
                lines.append(f"| {part['name']} | part.{key} | {part[key]} |")
        for item in part.get("skipped", []):
            lines.append(f"| {part['name']} | skipped: {item['what']} | {item['reason']} |")
        if "error" in part:
            lines.append(f"| {part['name']} | error | {part['error'][:200].replace('|', '/')} |")
        for key, value in numbers(part.get("result") or {}):
            shown = f"{value:.6g}" if isinstance(value, float) else str(value)
            lines.append(f"| {part['name']} | {key} | {shown} |")
    return "\n".join(lines) + "\n"


def summary(record: dict) -> str:
    rows = [f"{p['name']:15s} {p['status']:10s} {p.get('seconds', 0):7.1f} s" for p in record["parts"]]
    return "\n".join(["part            status     seconds", *rows, f"total {record['total_s']} s"])


if __name__ == "__main__":
    sys.exit(main())
