"""Measurement: the recovery curve of issue 10. Uptraining from each start (a merge, with or without
`--refine`) for alpha = 0.5%, 1%, 2.5% and 5% of the parent's pretraining tokens, held-out perplexity
at each, the parent as the reference line.

    python bench/refine_recovery.py --kv 2,1 --out bench/results/refine/recovery-austen-mha.json \
        --plot docs/refine-recovery.png
    python bench/refine_recovery.py --merge a.json,b.json --out all.json --plot p.png   # combine runs
    python bench/refine_recovery.py --smoke          # ~25 s; run by a slow test

Starts: `mean`, `calibrated`, `calibrated+refine`, `mean+refine` (a merge from calibration statistics
gathered once, then `--refine` at its defaults), and `parent` (the parent itself uptrained the same way:
what the training text alone does to held-out perplexity). Each start is converted once and reused for
every alpha. Each alpha is its own run from that start, with its own warmup + cosine schedule sized to
its budget (mha2gqa/demo/demo-uptrain.yaml, the demo's recipe, with a smaller micro-batch so that
alpha = 0.5% is several steps): a curve read off one 5% run would report mid-schedule, high-LR
weights at the smaller alphas. Perplexity: the first --eval-tokens tokens of held-out Persuasion in
non-overlapping windows of the model's context, exactly as bench/refine.py (numbers compare with
docs/refine.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrated_merge import calibrate_on_corpus, heldout_ids, model_perplexity  # noqa: E402

STARTS = ("calibrated+refine", "calibrated", "mean", "mean+refine", "parent")
ALPHAS = (0.005, 0.01, 0.025, 0.05)
# Issue 10: with uptraining, within this share of the parent's perplexity by alpha = 0.5%.
TARGETS = {2: 0.01, 1: 0.02}


def convert_start(args, source: Path, stats, kv: int, start: str, out: Path) -> dict:
    from mha2gqa.convert.options import RefineOptions
    from mha2gqa.convert.run import convert

    method, _, refine = start.partition("+")
    options = RefineOptions(steps=args.refine_steps, tokens=args.refine_tokens) if refine else None
    started = time.perf_counter()
    convert(source, out, kv, method=method, stats=stats, refine=options, progress=False, force=True, check=False)
    return {"convert_s": round(time.perf_counter() - started, 1)}


def uptrain(args, model: Path, source: Path, out: Path, alpha: float, total: int) -> int:
    """One run of the demo recipe from `model` for alpha x total tokens; returns the tokens it trained on."""
    from mha2gqa.demo.pipeline import DEMO_RECIPE, embedded_run_overrides
    from mha2gqa.uptrain import load_recipe, train
    from mha2gqa.uptrain.plan import tokens_per_step, total_steps

    overrides = (
        embedded_run_overrides(model, out, eval_blocks=1)
        + [
            f"tokenizer={source}",
            f"budget.alpha={alpha}",
            f"budget.pretrain_tokens={total}",
            f"micro_batch_size={args.micro_batch}",
            f"optim.warmup_steps={args.warmup}",
            "eval_at_start=false",
            "eval_every=0",
            "save_every=0",
            "log_every=1000",
        ]
        + ([f"optim.lr={args.lr}"] if args.lr else [])
    )
    recipe = load_recipe(DEMO_RECIPE, overrides)
    train(recipe)
    return total_steps(recipe, 1) * tokens_per_step(recipe, 1)


def run(args) -> dict:
    from mha2gqa.architecture.layouts import read_config
    from mha2gqa.files import embedded

    source = Path(args.model)
    config = read_config(source)
    context = min(args.context, config.get("max_position_embeddings") or args.context)
    total = args.pretrain_tokens or embedded.pretrain_tokens()
    ids = heldout_ids(source, None, args.eval_tokens)
    parent = model_perplexity(source, ids, context)
    result = {
        "model": str(source),
        "parent_perplexity": parent,
        "eval_tokens": len(ids),
        "context": context,
        "pretrain_tokens": total,
        "alphas": args.alphas,
        "micro_batch_size": args.micro_batch,
        "warmup_steps": args.warmup,
        "lr": args.lr,
        "recipe": "mha2gqa/demo/demo-uptrain.yaml",
        "calibration": args.calibration,
        "calibration_tokens": args.calibration_tokens,
        "refine_steps": args.refine_steps,
        "refine_tokens": args.refine_tokens,
        "load_average_start": os.getloadavg(),
        "rows": [],
    }
    print(f"parent: ppl {parent:.2f} on {len(ids)} tokens; load {os.getloadavg()}", flush=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="refine-recovery-"))
    (work / "stats").mkdir(parents=True, exist_ok=True)
    stats = None  # gathered once, on the first conversion that needs it
    for kv in args.kv:
        for start in args.starts:
            if start == "parent" and kv != args.kv[0]:
                continue  # the parent's own curve does not depend on kv
            model = source if start == "parent" else work / f"{start}-kv{kv}"
            row = {"kv_heads": None if start == "parent" else kv, "start": start}
            if start != "parent" and args.reuse and (model / "config.json").exists():
                row["reused"] = True  # converted by an earlier run into the same --workdir
            elif start != "parent":
                if stats is None:
                    stats = calibrate_on_corpus(
                        source, config, args.calibration, args.calibration_tokens, work / "stats"
                    )
                row.update(convert_start(args, source, stats, kv, start, model))
            points = [{"alpha": 0.0, "tokens": 0, "perplexity": model_perplexity(model, ids, context)}]
            for alpha in args.alphas:
                out = work / f"{start}-kv{kv}-alpha{alpha}"
                started = time.perf_counter()
                tokens = uptrain(args, model, source, out, alpha, total)
                points.append(
                    {
                        "alpha": alpha,
                        "tokens": tokens,
                        "perplexity": model_perplexity(out, ids, context),
                        "train_s": round(time.perf_counter() - started, 1),
                    }
                )
            row.update(points=points, load_average=os.getloadavg())
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # after every start, so a stopped run keeps what finished
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def merged(paths: list[str]) -> dict:
    """One result from several runs of this script on the same model and eval (e.g. one per kv)."""
    parts = [json.loads(Path(path).read_text()) for path in paths]
    rows: dict[tuple, dict] = {}  # (kv, start) -> row; runs that reused a conversion add their alphas to it
    for part in parts:
        if not math.isclose(part["parent_perplexity"], parts[0]["parent_perplexity"]):
            raise SystemExit(f"--merge: {paths} differ in parent perplexity (different model or eval)")
        for row in part["rows"]:
            if part.get("lr"):  # another recipe: its own line
                row = dict(row, start=f"{row['start']} @ lr {part['lr']:g}")
            kept = rows.setdefault((row["kv_heads"], row["start"]), dict(row, points=[]))
            if "convert_s" in row:
                kept["convert_s"] = row["convert_s"]
            known = {p["alpha"] for p in kept["points"]}
            kept["points"] = sorted(
                kept["points"] + [p for p in row["points"] if p["alpha"] not in known], key=lambda p: p["alpha"]
            )
    alphas = sorted({p["alpha"] for row in rows.values() for p in row["points"]} - {0.0})
    return dict(
        parts[0],
        rows=list(rows.values()),
        alphas=alphas,
        sources=paths,
        load_average_end=parts[-1].get("load_average_end"),
    )


def target_checks(result: dict) -> list[dict]:
    """Issue 10's uptraining targets, per (kv, start): perplexity at alpha = 0.5% within the share."""
    parent, checks = result["parent_perplexity"], []
    for row in result["rows"]:
        share = TARGETS.get(row["kv_heads"])
        at = next((p for p in row["points"] if math.isclose(p["alpha"], 0.005)), None)
        if share is None or at is None:
            continue
        excess = at["perplexity"] / parent - 1
        checks.append(
            {
                "kv_heads": row["kv_heads"],
                "start": row["start"],
                "excess": excess,
                "target": share,
                "met": excess <= share,
            }
        )
    return checks


def table(result: dict) -> str:
    alphas = result["alphas"]
    head = "| kv heads | start | " + " | ".join(f"alpha {a:g}" for a in [0.0] + alphas) + " | convert s |"
    lines = [
        f"parent: {result['parent_perplexity']:.2f} (the first {result['eval_tokens']} tokens of Persuasion)",
        "",
        head,
        "|---|---|" + "---:|" * (len(alphas) + 2),
    ]
    for row in result["rows"]:
        by_alpha = {p["alpha"]: p["perplexity"] for p in row["points"]}
        cells = " | ".join(f"{by_alpha[a]:.2f}" if a in by_alpha else "" for a in [0.0] + alphas)
        lines.append(
            f"| {row['kv_heads'] or '-'} | {row['start']} | {cells} | {row.get('convert_s', 'reused' if row.get('reused') else '')} |"
        )
    for check in target_checks(result):
        lines.append(
            f"\nkv {check['kv_heads']} {check['start']}: {check['excess']:+.2%} of the parent at alpha 0.5% "
            f"(target <= {check['target']:.0%}): {'met' if check['met'] else 'missed'}"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvs = sorted({row["kv_heads"] for row in result["rows"] if row["kv_heads"]}, reverse=True)
    figure, axes = plt.subplots(1, len(kvs), figsize=(6 * len(kvs), 4.5), squeeze=False)
    parent = result["parent_perplexity"]
    for axis, kv in zip(axes[0], kvs):
        for row in result["rows"]:
            if row["kv_heads"] in (kv, None):
                style = "--" if row["start"].startswith("parent") else "-"
                label = row["start"].replace("parent", "parent uptrained", 1)
                axis.plot(
                    [p["tokens"] for p in row["points"]],
                    [p["perplexity"] for p in row["points"]],
                    style,
                    marker="o",
                    label=label,
                )
        axis.axhline(parent, color="black", linewidth=1, label=f"parent {parent:.2f}")
        if kv in TARGETS:
            axis.axhline(
                parent * (1 + TARGETS[kv]),
                color="grey",
                linestyle=":",
                linewidth=1,
                label=f"target: parent + {TARGETS[kv]:.0%}",
            )
        axis.set_yscale("log")
        axis.set_title(f"{kv} kv head{'s' if kv > 1 else ''}")
        axis.set_xlabel(f"uptraining tokens (alpha x {result['pretrain_tokens']:,})")
        axis.set_ylabel("perplexity, held-out Persuasion")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    from mha2gqa.files import embedded

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(embedded.model_dir()), help="MHA source model directory")
    parser.add_argument("--kv", default="2,1", help="target kv-head counts, comma-separated")
    parser.add_argument("--starts", default=",".join(STARTS), help=f"from: {', '.join(STARTS)}")
    parser.add_argument("--alphas", default=",".join(map(str, ALPHAS)))
    parser.add_argument("--pretrain-tokens", type=int, default=None, help="default: the embedded model's")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per step (the demo uses 8)")
    parser.add_argument("--lr", type=float, default=None, help="peak optim.lr (default: the recipe's 3e-4)")
    parser.add_argument("--warmup", type=int, default=2, help="optim.warmup_steps of every run")
    parser.add_argument("--calibration", default="austen")
    parser.add_argument("--calibration-tokens", type=int, default=65536)
    parser.add_argument("--refine-steps", type=int, default=50)
    parser.add_argument("--refine-tokens", type=int, default=None, help="default: --refine's (64 x hidden)")
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--workdir", default=None, help="keep converted and uptrained models here")
    parser.add_argument("--reuse", action="store_true", help="reuse conversions already in --workdir")
    parser.add_argument(
        "--merge",
        default=None,
        help="combine these results JSONs (comma-separated) and only print, --out and --plot them",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: kv 2, two starts, one step per alpha")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write the recovery plot (PNG) here")
    args = parser.parse_args()
    if args.smoke:  # 20,480 "pretraining" tokens: alpha 0.05 is one step of 1,024 tokens
        args.kv, args.starts, args.alphas, args.pretrain_tokens = "2", "mean,calibrated+refine", "0.05,0.1", 20480
        args.calibration_tokens, args.eval_tokens, args.refine_steps = 2048, 2048, 3
    args.kv = [int(k) for k in str(args.kv).split(",")]
    args.starts = args.starts.split(",")
    args.alphas = [float(a) for a in str(args.alphas).split(",")]
    unknown = [s for s in args.starts if s not in STARTS]
    if unknown:
        raise SystemExit(f"--starts {','.join(unknown)} unknown (valid: {', '.join(STARTS)})")
    result = merged(args.merge.split(",")) if args.merge else run(args)
    result["targets"] = target_checks(result)
    result.setdefault("load_average_end", os.getloadavg())
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, Path(args.plot))


if __name__ == "__main__":
    main()
