"""The real model's recovery (issue 36, item 4): how far distillation on the parent's own samples, with no data
of the user's, brings a converted model back, per probe domain, from each start.

    flock -s /work/locks/cpu python bench/recovery_real.py $SMOLLM2 --threads 1 --work runs/recovery \
        --out bench/results/recovery/smollm2-kv1-cpu.json --plot docs/recovery-real.png
    python bench/recovery_real.py $SMOLLM2 --recipe distill-parent-gpu --steps 4,16,64 \
        --set optim.schedule=constant --sampling '{"batch": 256}' --work W --out W/r.json   # the GPU part
    python bench/recovery_real.py --smoke          # the embedded model at toy sizes (tests/test_bench_smoke.py)

Starts (--starts): `mean`, the paper's recipe (`mha2gqa convert PARENT DIR --groups K`), and `calibrated`, the
calibrated merge + --refine on the no-data default calibration (`... --method calibrated --refine --seed S`),
each converted once into WORK/<start> by the CLI unless a finished conversion is there already; `--start
NAME=DIR` takes one made elsewhere. Each start is then distilled from its parent once with a shipped recipe
(`mha2gqa uptrain --recipe distill-parent-cpu model=START distill.teacher=PARENT output_dir=WORK/<start>-distilled`,
data.train: [parent], in this process), its budget the last of --steps: the run stops and saves a resumable
checkpoint at every earlier step count of --steps (exit_after_steps, then --resume: exactly the uninterrupted
run), so one run gives every point. The recipe's lr is constant after 2 warmup steps: the checkpoint at step n
holds what a run of n steps would reach (on other samples of the same draw). The teacher's samples are drawn once
for the whole budget and kept in MHA2GQA_CACHE (mha2gqa/uptrain/sample_cache.py): the second start reads them.

Every point (the start, each checkpoint, the final model) is scored like `bench/calibration_domains.py --score`:
the first --eval-tokens tokens of each probe domain in windows of --context, the perplexity ratio to the
parent, their geometric mean. Finished pieces (a conversion, a run, a scored point) are kept in WORK and not
redone, so a killed run continues where it stopped. Times are wall seconds with the load average beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration_domains import domain_perplexities, geometric_mean, probe_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STARTS = {"mean": [], "calibrated": ["--method", "calibrated", "--refine"]}  # convert's arguments of each start
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def convert_start(args, name: str, folder: Path) -> dict:
    """WORK/<name> converted by the CLI (as a user runs it), unless a finished conversion is there."""
    command = [sys.executable, "-m", "mha2gqa", *threads(args), "convert", str(args.model), str(folder)]
    command += ["--groups", str(args.kv), *STARTS[name]] + (["--seed", str(args.seed)] if STARTS[name] else [])
    command += shlex.split(args.convert_args) + (shlex.split(args.calibrated_args) if name == "calibrated" else [])
    record = {"command": " ".join(["mha2gqa", *command[3:]]).replace(str(args.model), "PARENT")}
    if (folder / "mha2gqa.json").is_file():
        return {**record, "reused": True}
    before, started = load_average(), time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return {**record, "wall_s": round(time.perf_counter() - started, 1), "load": [before, load_average()]}


def conversion_record(folder: Path) -> dict:
    """What a start converted elsewhere says of itself (its mha2gqa.json): the command, method, seed, check."""
    from mha2gqa.records.provenance import latest

    stage = latest(folder, "conversion") or {}
    keys = ("command", "method", "seed", "calibration", "date")
    record = {k: stage.get(k) for k in keys if stage.get(k) is not None}
    verdict = (stage.get("check") or {}).get("verdict")
    return {**record, "reused": True, **({"check_verdict": verdict} if verdict else {})}


def threads(args) -> list[str]:
    return ["--threads", str(args.threads)] if args.threads else []


def overrides(args, start: Path, out: Path) -> list[str]:
    """The shipped recipe's keys this measurement sets: the models, the budget, a checkpoint at every stop."""
    keys = [f"model={start}", f"distill.teacher={args.model}", f"output_dir={out}"]
    keys += [f"budget.max_steps={args.budget}", "save_every=0", f"keep_last={len(args.steps)}"]
    return keys + args.set


def done_steps(out: Path) -> int:
    """How far the run in `out` got: its final model's steps, else its newest checkpoint's, else 0."""
    from mha2gqa.records.provenance import latest
    from mha2gqa.uptrain import checkpoints

    if (out / "mha2gqa.json").is_file() and (out / "model.safetensors").is_file():
        return latest(out, "uptrain")["steps"]
    found = checkpoints.complete_checkpoints(out)
    return checkpoints.read_progress(found[-1])["step"] if found else 0


def distill(args, start: Path, out: Path) -> list[dict]:
    """Train from `start` up to every stop of --steps in turn (one run, stopped and resumed); each leg's wall
    time and load. A leg already done (a checkpoint or the final model there) is skipped."""
    from mha2gqa.uptrain import load_recipe, train

    legs = []
    for stop in args.steps:
        done = done_steps(out)
        if done >= stop:
            continue
        keys = overrides(args, start, out) + ([f"exit_after_steps={stop - done}"] if stop < args.budget else [])
        before, started = load_average(), time.perf_counter()
        train(load_recipe(args.recipe, keys), resume=done > 0)
        legs.append({"steps": [done, stop], "wall_s": round(time.perf_counter() - started, 1)})
        legs[-1]["load"] = [before, load_average()]
        print(json.dumps({"leg": str(out), **legs[-1]}), flush=True)
    return legs


def point_folder(start: Path, out: Path, step: int) -> Path:
    """A loadable model folder of the run's state at `step`: the start (step 0), the final model, or a
    checkpoint's weights beside the start's config and tokenizer (links, nothing copied)."""
    from mha2gqa.uptrain import checkpoints

    if step == 0:
        return start
    if step == done_steps(out) and not checkpoints.checkpoint_dir(out, step).is_dir():
        return out
    folder = out / "points" / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    for name in [n for n in MODEL_FILES if (start / n).is_file()] + ["model.safetensors"]:
        source = checkpoints.checkpoint_dir(out, step) / name if name == "model.safetensors" else start / name
        link = folder / name
        if not link.exists():
            link.symlink_to(source.resolve())
    return folder


def score_points(args, name: str, start: Path, out: Path, sets: dict, parent: dict, known: list) -> list[dict]:
    """Each point of one start scored per domain (a point in `known`, the JSON of an earlier run, is kept)."""
    from mha2gqa.uptrain.plan import tokens_per_step

    kept = {p["step"]: p for p in known}
    per_step = tokens_per_step(recipe_of(args, start, out), 1)
    points = []
    for step in [0, *args.steps]:
        if step in kept:
            points.append(kept[step])
            continue
        before, started = load_average(), time.perf_counter()
        measured = domain_perplexities(point_folder(start, out, step), sets, args.context)
        ratios = {d: round(measured[d] / parent[d], 4) for d in measured}
        points.append({"step": step, "tokens": step * per_step, "perplexity": measured, "ratio": ratios})
        points[-1] |= {
            "geometric_mean": round(geometric_mean(ratios), 4),
            "score_s": round(time.perf_counter() - started, 1),
        }
        points[-1]["load"] = [before, load_average()]
        print(json.dumps({"start": name, **points[-1]}), flush=True)
    return points


def recipe_of(args, start: Path, out: Path):
    from mha2gqa.uptrain import load_recipe

    return load_recipe(args.recipe, overrides(args, start, out), validate_files=False)


def held_out(out: Path) -> list[dict]:
    """The run's own eval on its held-out samples (metrics.jsonl), step by step."""
    path = out / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [{"step": r["step"], "tokens": r["tokens"], "eval_ppl": r["eval_ppl"]} for r in lines if "eval_ppl" in r]


def measure_start(args, name: str, sets: dict, result: dict) -> dict:
    """One start: converted (or reused), distilled to the last stop, every point scored."""
    start = args.given.get(name) or args.work / name
    out = args.work / f"{name}-distilled"
    entry = result["starts"].get(name, {})
    entry["folder"] = str(start)
    if name in args.given:
        entry["convert"] = conversion_record(start)
    else:
        entry["convert"] = entry.get("convert") or convert_start(args, name, start)
    entry["distill"] = entry.get("distill", []) + distill(args, start, out)
    entry["points"] = score_points(args, name, start, out, sets, result["parent"], entry.get("points", []))
    entry["held_out"] = held_out(out)
    entry["closing"] = closing(entry["points"], args.target)
    result["starts"][name] = entry
    return entry


def closing(points: list[dict], target: float) -> dict:
    """How much of the gap the run closed: 1 - log(last ratio) / log(first) by the geometric mean (1: the
    parent's perplexity reached, 0: no change), and the first tokens at which it was within `target` of the parent."""
    first, last = points[0]["geometric_mean"], points[-1]["geometric_mean"]
    within = next((p["tokens"] for p in points if p["geometric_mean"] <= target), None)
    share = 1 - math.log(last) / math.log(first) if first > 1 else None
    return {"gap_closed": None if share is None else round(share, 4), "target": target, "tokens_within_target": within}


def table(result: dict) -> str:
    domains = list(result["parent"])
    lines = ["| start | tokens | " + " | ".join(domains) + " | geometric mean |", "|---" * (len(domains) + 3) + "|"]
    for name, entry in result["starts"].items():
        for p in entry["points"]:
            cells = " | ".join(f"{p['ratio'][d]:.2f}x" for d in domains)
            lines.append(f"| {name} | {p['tokens']:,} | {cells} | **{p['geometric_mean']:.2f}x** |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """One panel a domain and one for the geometric mean: the ratio to the parent against distillation tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    panels = [*result["parent"], "geometric mean"]
    figure, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.8), sharey=True)
    for axis, panel in zip(axes, panels):
        for name, entry in result["starts"].items():
            tokens = [p["tokens"] for p in entry["points"]]
            ratios = [p["geometric_mean"] if panel == "geometric mean" else p["ratio"][panel] for p in entry["points"]]
            axis.plot(tokens, ratios, marker="o", label=f"{name} start")
        axis.axhline(1.0, color="black", linewidth=1, label="the parent")
        axis.set_yscale("log")
        axis.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
        axis.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}x" if leading_digit(y) in (2, 5) else ""))
        if wide_range(result):  # a GPU run's points span decades: 0 stays on the axis
            axis.set_xscale("symlog", linthresh=min_positive_tokens(result))
        axis.xaxis.set_major_formatter(FuncFormatter(lambda x, _: short_count(x)))
        axis.margins(x=0.08)
        axis.set_title(panel)
        axis.set_xlabel("distillation tokens (parent's samples)")
    axes[0].set_ylabel("perplexity / the parent's")
    axes[0].legend(fontsize=8)
    model = Path(result["model"]).name
    figure.suptitle(
        f"{model}, {result['kv_from']} -> {result['kv_heads']} kv heads, distilled with --recipe {result['recipe']}: "
        f"measured on the first {result['eval_tokens']:,} tokens of each probe domain, windows of {result['context']}",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def min_positive_tokens(result: dict) -> int:
    return min((p["tokens"] for e in result["starts"].values() for p in e["points"] if p["tokens"]), default=1)


def wide_range(result: dict) -> bool:
    most = max((p["tokens"] for e in result["starts"].values() for p in e["points"]), default=0)
    return most > 20 * min_positive_tokens(result)


def leading_digit(y: float) -> int:
    return round(y / 10 ** math.floor(math.log10(y))) if y > 0 else 0


def short_count(x: float) -> str:
    """25600 -> 25.6k, 4194304 -> 4.19M: tick labels that fit a narrow panel."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:g}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=Path, help="the parent model folder (omit with --smoke)")
    parser.add_argument("--kv", type=int, default=1, help="kv heads of the converted model")
    parser.add_argument("--starts", nargs="+", default=list(STARTS), choices=list(STARTS))
    parser.add_argument("--start", nargs="+", default=[], metavar="NAME=DIR", help="a start converted elsewhere")
    parser.add_argument("--seed", type=int, default=1, help="convert --seed of the calibrated start")
    parser.add_argument("--convert-args", default="", help='more convert flags for every start, e.g. "--no-check"')
    parser.add_argument("--calibrated-args", default="", help="more convert flags for the calibrated start")
    parser.add_argument("--recipe", default="distill-parent-cpu", help="a shipped recipe's name, or a YAML file")
    parser.add_argument(
        "--steps", help="optimizer steps of every point, the last the budget (default 12,25,50; --smoke 1,2)"
    )
    parser.add_argument(
        "--budget-steps",
        type=int,
        help="the run's budget.max_steps when above the last of --steps (a comparison stopped early on the same "
        "samples as a longer run: the samples are drawn, and cached, for the whole budget)",
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more recipe overrides")
    parser.add_argument("--sampling", type=json.loads, default={}, help='SamplingRecipe keywords, e.g. {"batch": 256}')
    parser.add_argument("--threads", type=int, help="mha2gqa --threads for every conversion and run")
    parser.add_argument("--target", type=float, default=1.1, help="a ratio to the parent that counts as closed")
    parser.add_argument("--eval-tokens", type=int, default=4096, help="tokens of each probe domain")
    parser.add_argument("--context", type=int, default=512, help="perplexity window")
    parser.add_argument("--work", type=Path, help="where the starts and runs are kept (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="JSON file for the result (an earlier one's points are kept)")
    parser.add_argument("--plot", type=Path, help="PNG of the ratios against distillation tokens")
    parser.add_argument("--smoke", action="store_true", help="the embedded model at toy sizes")
    args = parser.parse_args(argv)
    if args.smoke:  # 8 -> 1 kv heads, 2 steps of 2 blocks of 64 sampled tokens, a stop after the first
        from mha2gqa.files.embedded import MODEL_DIR

        args.model, args.steps, args.eval_tokens, args.context = MODEL_DIR, args.steps or "1,2", 256, 128
        args.convert_args = "--no-check"
        args.calibrated_args = "--calibration austen --calibration-tokens 1024 --refine-steps 2 --refine-global-steps 2"
        args.set = ["seq_len=64", "micro_batch_size=2", "data.eval_blocks=2", "eval_every=0", *args.set]
        args.set += ["tensorboard=false"]
    if args.model is None:
        parser.error("give the parent model folder (or --smoke)")
    args.steps = sorted({int(s) for s in str(args.steps or "12,25,50").split(",")})
    args.budget = max(args.budget_steps or 0, args.steps[-1])
    args.given = {name: Path(folder) for name, _, folder in (item.partition("=") for item in args.start)}
    return args


def earlier(args, settings: dict) -> dict:
    """The result an earlier run of the same measurement wrote to --out, whose points are kept."""
    if args.out and args.out.is_file():
        found = json.loads(args.out.read_text())
        if all(found.get(k) == v for k, v in settings.items()):
            return found
    return {**settings, "starts": {}}


def main(argv=None) -> dict:
    import tempfile

    from mha2gqa.architecture.layouts import read_config
    from mha2gqa.runtime.threads import apply

    args = parse_args(argv)
    if args.threads:
        os.environ["MHA2GQA_THREADS"] = str(args.threads)
        apply()
    if args.sampling:  # every sampling reads the module's default recipe when called
        from mha2gqa.corpus import sampling

        sampling.DEFAULT_RECIPE = sampling.SamplingRecipe(**args.sampling)
    with tempfile.TemporaryDirectory(prefix="recovery-") as scratch:
        args.work = args.work or Path(scratch)
        args.work.mkdir(parents=True, exist_ok=True)
        settings = {"model": str(args.model), "kv_heads": args.kv, "recipe": args.recipe, "steps": args.steps}
        settings |= {"budget_steps": args.budget} if args.budget > args.steps[-1] else {}
        settings |= {
            "set": args.set,
            "sampling": args.sampling,
            "eval_tokens": args.eval_tokens,
            "context": args.context,
        }
        result = earlier(args, settings)
        result["kv_from"] = read_config(args.model)["num_key_value_heads"]
        sets = probe_ids(args.model, args.eval_tokens)
        result["parent"] = result.get("parent") or domain_perplexities(args.model, sets, args.context)
        for name in [*args.starts, *[n for n in args.given if n not in args.starts]]:
            measure_start(args, name, sets, result)
            write(args, result)
        print(table(result))
        return result


def write(args, result: dict) -> None:
    result["load_average_end"] = load_average()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
