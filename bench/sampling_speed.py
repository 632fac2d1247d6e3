"""The cost of a sampled token (`--calibration parent`, corpus/sampling.py): sample_ids with the shipped
nucleus draw (only the rows whose nucleus is wider than the top-k candidates sorted in full) against the
draw it replaced (the whole batch sorted and drawn over the vocabulary once any row was wide), side by
side, alternating, medians of --repeats.

    OMP_NUM_THREADS=2 python bench/sampling_speed.py $SMOLLM2 --batch 16 64 --seq-len 64 --repeats 3 \
        --out bench/results/sampling/smollm2.json

Run it alone on a quiet machine: it times. `--smoke` runs the embedded model at toy sizes
(tests/test_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrated_merge import load_float32  # noqa: E402


def whole_batch_draw(logits, recipe, generator):
    """The draw before: one full sort and one draw over the vocabulary for every row of a batch holding a
    wide row (the baseline)."""
    from mha2gqa.corpus.sampling import NUCLEUS_CANDIDATES, nucleus_pick

    probs = torch.softmax(logits / recipe.temperature, dim=-1)
    ordered, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)
    if bool((ordered.sum(-1) < recipe.top_p).any()):
        ordered, order = probs.sort(dim=-1, descending=True)
    return nucleus_pick(ordered, order, recipe.top_p, generator)


def ms_per_token(model, tokenizer, batch: int, seq_len: int, draw) -> float:
    from mha2gqa.corpus import sampling

    shipped, sampling.nucleus_draw = sampling.nucleus_draw, draw
    try:
        recipe = sampling.SamplingRecipe(batch=batch)
        started = time.perf_counter()
        ids = sampling.sample_ids(model, tokenizer, batch * seq_len, seq_len, 0, recipe, progress=False)
        return (time.perf_counter() - started) / len(ids) * 1000
    finally:
        sampling.nucleus_draw = shipped


def main(argv=None) -> dict:
    from transformers import AutoTokenizer

    from mha2gqa.corpus import sampling

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="the model folder (omit with --smoke)")
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64], help="sequences drawn at once")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="JSON file for the result")
    parser.add_argument("--smoke", action="store_true", help="the embedded model at toy sizes")
    args = parser.parse_args(argv)
    if args.smoke:
        from mha2gqa.files.embedded import MODEL_DIR

        args.model, args.batch, args.seq_len, args.repeats = str(MODEL_DIR), [4], 16, 1
    model, tokenizer = load_float32(Path(args.model)), AutoTokenizer.from_pretrained(args.model)
    draws = {"shipped": sampling.nucleus_draw, "whole_batch": whole_batch_draw}
    result = {"model": args.model, "seq_len": args.seq_len, "threads": torch.get_num_threads(), "rows": []}
    for batch in args.batch:
        times = {name: [] for name in draws}
        for _ in range(args.repeats):
            for name, draw in draws.items():
                times[name].append(ms_per_token(model, tokenizer, batch, args.seq_len, draw))
        medians = {name: statistics.median(t) for name, t in times.items()}
        row = {"batch": batch, "ms_per_token": medians, "runs": times, "load_average": list(os.getloadavg())}
        row["speedup"] = medians["whole_batch"] / medians["shipped"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
