"""Which layers `--kv-budget` keeps when its layer losses convert each layer by the calibrated merge rather than by
mean-pooling, and what each choice loses when measured whole under the calibrated merge (every chosen layer
converted at once, no refine): the tables of docs/convert.md ("Layer losses through the merge").

    python bench/budget_merges.py $SMOLLM2 --calibration austen --budgets 0.5,0.6667 \
        --out bench/results/budget_merges.json
    python bench/budget_merges.py --smoke --out /tmp/budget_merges.json   # the embedded model at toy sizes

One parent load, one calibration read and one statistics pass serve both measurements (convert's own functions:
layer_losses.measure with the plan's merge, kv_budget.choose_counts, WholePlacements.measure). Prints one line a
placement and writes every loss (per layer, text and retrieval, both merges), the counts and the whole losses as JSON.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from mha2gqa.files import jsontext

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "mha2gqa" / "data" / "austen-mha"
MERGES = ("calibrated", "mean")


def measure(model: Path, calibration: str, budgets: list[str], seed: int, tokens: int | None) -> dict:
    """Both merges' losses, each budget's counts from each, and every placement measured whole."""
    with tempfile.TemporaryDirectory(prefix="budget-merges-") as scratch:
        return _measure(Path(scratch), model, calibration, budgets, seed, tokens)


def _measure(unused: Path, model: Path, calibration: str, budgets: list[str], seed: int, tokens: int | None) -> dict:
    from mha2gqa.convert import layer_losses
    from mha2gqa.convert.calibration import gather, load_source_model
    from mha2gqa.convert.kv_budget import choose_counts
    from mha2gqa.convert.options import ConvertOptions
    from mha2gqa.convert.run import plan_conversion
    from mha2gqa.corpus.calibration import read_calibration

    def plan(budget: str, method: str):
        options = ConvertOptions(kv_budget=budget, method=method, calibration=calibration, calibration_tokens=tokens,
                                 seed=seed, progress=False, check=False)  # fmt: skip
        return plan_conversion(model, unused / "dst", options)

    plans = {(b, m): plan(b, m) for b in budgets for m in MERGES}
    first = plans[budgets[0], "calibrated"]
    started = time.perf_counter()
    parent = load_source_model(first.source, first.decided.device, progress=False)
    ids, record = read_calibration(first.calibration, first.source, seed, lambda: parent, progress=False)
    stats = gather(parent, first.calibration, ids, record, first.layout, first.shape, first.source, unused,
                   first.calibration_memory, False)  # fmt: skip
    found = {
        "model": str(model),
        "calibration": calibration,
        "seed": seed,
        "statistics_s": time.perf_counter() - started,
    }
    measured = {}
    for method in MERGES:
        started = time.perf_counter()
        measured[method] = layer_losses.measure(parent, ids, plans[budgets[0], method], record, stats=stats)
        losses = measured[method]
        found[method] = {"text": losses.losses, "retrieval": losses.retrieval, "seconds": time.perf_counter() - started}
    placements = {
        f"{budget} {method}": choose_counts(layer_losses.weighed(measured[method]), plans[budget, method].budget_heads)
        for budget in budgets
        for method in MERGES
    }
    whole = measured["calibrated"].whole.measure(list(placements.values()))  # under the calibrated merge
    found["placements"] = {
        name: {"counts": list(counts), "whole_text": text, "whole_retrieval": copy}
        for (name, counts), (text, copy) in zip(placements.items(), whole)
    }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="the parent model folder (omit with --smoke)")
    parser.add_argument("--calibration", default="austen")
    parser.add_argument("--budgets", default="0.5,0.6667")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="the embedded model at toy sizes")
    args = parser.parse_args()
    model, tokens = (EMBEDDED, 2048) if args.smoke else (Path(args.model), None)
    found = measure(model, args.calibration, args.budgets.split(","), args.seed, tokens)
    found["load"] = os.getloadavg()[0]
    for name, entry in found["placements"].items():
        kept = [layer for layer, count in enumerate(entry["counts"]) if count == max(entry["counts"])]
        print(
            f"{name}: layers kept {kept}, whole text {entry['whole_text']:.4f}, retrieval {entry['whole_retrieval']:.4f}"
        )
    Path(args.out).write_text(jsontext.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
