"""Measurement: uptraining from each initialisation (alpha = 5% of the pretraining tokens by default),
for mean, mean-norm, calibrated and calibrated + similarity grouping.

    python bench/calibrated_uptrain.py --kv 2 --out uptrain.json           # the embedded Austen model
    python bench/calibrated_uptrain.py --model DIR --pretrain-tokens N --kv 1,2,4
    python bench/calibrated_uptrain.py --smoke --out /tmp/u.json   # mean and calibrated, 3 toy steps each

Each variant is converted (calibration statistics gathered once, as in bench/calibrated_merge.py),
then uptrained with recipes/bench/calibrated-uptrain.yaml (plain LM loss, constant LR, eval on held-out
Persuasion every 3 steps). Reported: eval perplexity at the start and the end, and the tokens each
variant needed to reach mean-pooling's final perplexity (issue 6 target for calibrated: at most half).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "bench" / "calibrated-uptrain.yaml"
VARIANTS = {
    "mean": ("mean", "contiguous"),
    "mean-norm": ("mean-norm", "contiguous"),
    "calibrated": ("calibrated", "contiguous"),
    "calibrated+similarity": ("calibrated", "similarity"),
}


def pretrain_tokens(model: Path) -> int | None:
    """Tokens the source saw, from the provenance the uptrain loop writes beside its final model."""
    from mha2gqa.records.provenance import latest

    found = latest(model, "uptrain") or {}
    return found.get("tokens_seen")


def curve(output_dir: Path) -> list[tuple[int, float]]:
    """(tokens, eval_ppl) of every eval line of a run's metrics.jsonl."""
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(line["tokens"], line["eval_ppl"]) for line in lines if line.get("eval_ppl") is not None]


def tokens_to_reach(points: list[tuple[int, float]], target: float) -> int | None:
    return next((tokens for tokens, ppl in points if ppl <= target), None)


def run(args) -> dict:
    import mha2gqa
    from mha2gqa.architecture.layouts import attention_shape, layout_for, read_config
    from mha2gqa.convert.calibration import (
        calibrate,
    )  # no public form: the statistics are gathered once, shared by every row
    from mha2gqa.files.embedded import expand_corpus_name
    from mha2gqa.uptrain import load_recipe, train

    source = Path(args.model)
    config = read_config(source)
    shape, layout = attention_shape(config), layout_for(config)
    total = args.pretrain_tokens or pretrain_tokens(source)
    if total is None:
        raise SystemExit(f"{source} has no uptrain.tokens_seen in mha2gqa.json: pass --pretrain-tokens")
    results = []
    work = Path(args.workdir or tempfile.mkdtemp(prefix="calibrated-uptrain-"))
    (work / "stats").mkdir(parents=True, exist_ok=True)
    stats = calibrate(
        source,
        layout,
        shape,
        expand_corpus_name(args.calibration),
        args.calibration_tokens,
        work / "stats",
        progress=False,
    )
    # The parent on the same eval blocks: the step-0 eval of a one-step run.
    train(
        load_recipe(
            RECIPE,
            [
                f"model={source}",
                f"output_dir={work / 'parent'}",
                "budget.alpha=null",
                "budget.max_steps=1",
                f"tokenizer={source}",
                *args.overrides,
            ],
        )
    )
    parent = curve(work / "parent")[0][1]
    print(json.dumps({"parent_ppl": parent}), flush=True)
    for kv in args.kv:
        for name in args.variants:
            method, grouping = VARIANTS[name]
            model_dir, out = work / f"{name}-kv{kv}", work / f"{name}-kv{kv}-uptrained"
            mha2gqa.convert(
                source,
                model_dir,
                kv,
                method=method,
                stats=stats,
                grouping=grouping,
                progress=False,
                force=True,
                check=False,
            )
            overrides = [
                f"model={model_dir}",
                f"output_dir={out}",
                f"budget.alpha={args.alpha}",
                f"budget.pretrain_tokens={total}",
                f"tokenizer={source}",
                *args.overrides,
            ]
            train(load_recipe(RECIPE, overrides))
            points = curve(out)
            results.append(
                {
                    "kv_heads": kv,
                    "variant": name,
                    "start_ppl": points[0][1],
                    "final_ppl": points[-1][1],
                    "final_tokens": points[-1][0],
                    "curve": points,
                }
            )
            print(json.dumps({k: v for k, v in results[-1].items() if k != "curve"}), flush=True)
    for row in results:
        mean = next(r for r in results if r["kv_heads"] == row["kv_heads"] and r["variant"] == "mean")
        row["tokens_to_mean_final"] = tokens_to_reach(row["curve"], mean["final_ppl"])
    return {
        "model": str(source),
        "alpha": args.alpha,
        "pretrain_tokens": total,
        "recipe": str(RECIPE),
        "parent_ppl": parent,
        "rows": results,
    }


def table(result: dict) -> str:
    lines = [
        f"alpha = {result['alpha']} of {result['pretrain_tokens']} pretraining tokens; parent ppl "
        f"{result['parent_ppl']:.2f} on the same eval blocks",
        "",
        "| kv heads | variant | ppl at start | ppl after | tokens to reach mean's final ppl |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        reach = row["tokens_to_mean_final"]
        share = "not reached" if reach is None else f"{reach} ({reach / row['final_tokens']:.0%})"
        lines.append(
            f"| {row['kv_heads']} | {row['variant']} | {row['start_ppl']:.2f} | {row['final_ppl']:.2f} | {share} |"
        )
    return "\n".join(lines)


def main() -> None:
    from mha2gqa.files import embedded

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(embedded.model_dir()))
    parser.add_argument("--kv", default="2", help="target kv-head counts, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from: {', '.join(VARIANTS)}")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--pretrain-tokens", type=int, default=None, help="default: from the model's mha2gqa.json")
    parser.add_argument("--calibration", default="austen")
    parser.add_argument("--calibration-tokens", type=int, default=65536)
    parser.add_argument("--workdir", default=None, help="keep converted and uptrained models here")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="kv 2, mean and calibrated only, 3 steps of 2 x 32 tokens, 2 eval blocks (run by a test)",
    )
    args = parser.parse_args()
    args.overrides = []
    if args.smoke:
        args.kv, args.variants, args.calibration_tokens = "2", "mean,calibrated", 512
        args.alpha, args.pretrain_tokens = 1.0, 3 * 2 * 32
        args.overrides = ["seq_len=32", "micro_batch_size=2", "data.eval_blocks=2", "log_every=1", "eval_every=1"]
    args.kv = [int(k) for k in args.kv.split(",")]
    args.variants = args.variants.split(",")
    result = run(args)
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
