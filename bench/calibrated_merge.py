"""Measurement: held-out perplexity right after conversion (alpha = 0) for mean, mean-norm, calibrated,
and calibrated + similarity grouping, at several kv-head counts, against the MHA parent.

    python bench/calibrated_merge.py                                  # the embedded Austen model
    python bench/calibrated_merge.py --model DIR --kv 1,2,4 --out results.json --keep runs/merged
    python bench/calibrated_merge.py --smoke --out /tmp/m.json         # kv 2, a few hundred tokens: seconds

Calibration statistics are gathered once (--calibration, default the five training novels) and shared by
every conversion; perplexity is on the first --eval-tokens tokens of held-out text (default Persuasion,
which neither the tokenizer nor the model saw), non-overlapping windows of the model's context.
"Gap closed" is (log ppl_mean - log ppl_method) / (log ppl_mean - log ppl_parent): the share of
mean-pooling's log-perplexity loss that a method recovers (issue 6 target for calibrated: >= 0.70).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = {  # row name -> (method, grouping)
    "mean": ("mean", "contiguous"),
    "mean-norm": ("mean-norm", "contiguous"),
    "calibrated": ("calibrated", "contiguous"),
    "calibrated+similarity": ("calibrated", "similarity"),
}


def calibrate_on_corpus(source, config: dict, corpus: str, tokens: int, folder: Path):
    """Calibration statistics of the model in `source` (`config`: its config.json) on `corpus` (a path or
    a built-in name such as austen), written to `folder`, without progress bars: every bench's one call."""
    from mha2gqa.architecture.layouts import attention_shape, layout_for
    from mha2gqa.convert.calibration import calibrate
    from mha2gqa.files.embedded import expand_corpus_name

    return calibrate(
        source, layout_for(config), attention_shape(config), expand_corpus_name(corpus), tokens, folder, progress=False
    )


def heldout_ids(source: Path, data: str | None, tokens: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    from mha2gqa.files import embedded

    text = Path(data).read_text(encoding="utf-8") if data else embedded.read_novel(embedded.HELDOUT_NOVEL)
    ids = AutoTokenizer.from_pretrained(source)(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids[:tokens], dtype=torch.long)


def load_float32(model_dir: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def loaded_perplexity(model, ids: torch.Tensor, context: int) -> float:
    """Perplexity of a loaded model over non-overlapping windows of `context` tokens: every bench's measure."""
    from mha2gqa.scoring.perplexity import perplexity

    return perplexity(model, ids, context=context, stride=context, batch_size=8)["perplexity"]


def model_perplexity(model_dir: Path, ids: torch.Tensor, context: int) -> float:
    return loaded_perplexity(load_float32(model_dir), ids, context)


def gap_closed(ppl: float, mean: float, parent: float) -> float:
    return (math.log(mean) - math.log(ppl)) / (math.log(mean) - math.log(parent))


def run(args) -> dict:
    import mha2gqa
    from mha2gqa.architecture.layouts import attention_shape, read_config

    source = Path(args.model)
    config = read_config(source)
    shape = attention_shape(config)
    context = min(args.context, config.get("max_position_embeddings") or args.context)
    ids = heldout_ids(source, args.eval_data, args.eval_tokens)
    parent = model_perplexity(source, ids, context)
    print(f"parent ({shape.kv_heads} kv heads): ppl {parent:.2f} on {len(ids)} held-out tokens", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="calibrated-bench-") as work:
        work = Path(work)
        (work / "stats").mkdir()
        started = time.perf_counter()
        stats = calibrate_on_corpus(source, config, args.calibration, args.calibration_tokens, work / "stats")
        print(f"calibration: {stats.tokens} tokens in {time.perf_counter() - started:.1f} s", flush=True)
        for kv in args.kv:
            for name in args.variants:
                method, grouping = VARIANTS[name]
                out = work / f"{name}-kv{kv}"
                started = time.perf_counter()
                result = mha2gqa.convert(
                    source, out, kv, method=method, stats=stats, grouping=grouping, progress=False, check=False
                )
                seconds = time.perf_counter() - started
                row = {
                    "kv_heads": kv,
                    "variant": name,
                    "perplexity": model_perplexity(out, ids, context),
                    "key_error": _mean(result.layers, "key_error"),
                    "value_error": _mean(result.layers, "value_error"),
                    "convert_s": round(seconds, 2),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.keep:
                    shutil.copytree(out, Path(args.keep) / out.name, dirs_exist_ok=True)
                shutil.rmtree(out)
    for row in rows:
        mean = next(r["perplexity"] for r in rows if r["kv_heads"] == row["kv_heads"] and r["variant"] == "mean")
        row["gap_closed"] = gap_closed(row["perplexity"], mean, parent) if mean > parent else None
    return {
        "model": str(source),
        "parent_kv_heads": shape.kv_heads,
        "parent_perplexity": parent,
        "eval_tokens": len(ids),
        "context": context,
        "calibration": stats.record,
        "rows": rows,
    }


def _mean(layers: list[dict], key: str) -> float:
    return sum(row[key] for row in layers) / len(layers)


def table(result: dict) -> str:
    lines = [
        f"parent: {result['parent_perplexity']:.2f} ({result['parent_kv_heads']} kv heads)",
        "",
        "| kv heads | variant | ppl | gap closed | key err | value err |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        gap = "" if row["gap_closed"] is None else f"{row['gap_closed']:.3f}"
        lines.append(
            f"| {row['kv_heads']} | {row['variant']} | {row['perplexity']:.2f} | {gap} | "
            f"{row['key_error']:.3f} | {row['value_error']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    from mha2gqa.files import embedded

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(embedded.model_dir()), help="MHA source model directory")
    parser.add_argument("--kv", default="1,2,4", help="target kv-head counts, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"rows to run, from: {', '.join(VARIANTS)}")
    parser.add_argument("--calibration", default="austen", help="calibration data (as convert --calibration)")
    parser.add_argument("--calibration-tokens", type=int, default=65536)
    parser.add_argument("--eval-data", default=None, help="held-out text file (default: Persuasion)")
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--keep", default=None, help="copy every converted model into this directory")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every variant at kv 2 with 512 calibration and 256 held-out tokens, context 64 (run by a test)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.kv, args.calibration_tokens, args.eval_tokens, args.context = "2", 512, 256, 64
    args.kv = [int(k) for k in args.kv.split(",")]
    args.variants = args.variants.split(",")
    result = run(args)
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
