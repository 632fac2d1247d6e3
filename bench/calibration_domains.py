"""Which calibration keeps a model's general ability: per calibration source and per stage, the converted
model's perplexity ratio to its parent on every domain of the probe set, their geometric mean, and the
conversion's wall time and peak RSS (each conversion a child process, as a user runs it).

    python bench/calibration_domains.py $SMOLLM2 --kv 1 --calibrations austen parent parent:0.5+austen:0.5 \
        --tokens 36864 --out bench/results/calibration/smollm2-kv1.json

Calibrations: what `convert --calibration` takes, '+' between the entries of a mix. Stages: `merge` (the
calibrated merge alone), `layerwise` (+ --refine --refine-global-steps 0) and `global` (+ the global KL
stage: the shipped default). Every calibration gets the same --tokens; each is read (or sampled) once and
its statistics gathered once, and every stage converts from them, refine fitting on the same ids, as a
sweep does. The times are per calibration (read + statistics) and per stage; one CLI run of the default
is the end-to-end figure (docs/calibration.md).
`--sampling '{"chat_share": 1.0}'` varies the parent's sampling recipe (corpus/sampling.py).
`--score DIR...` only scores existing folders (a conversion, then uptrained) the same way.
`--extra NAME=PATH ...` scores more texts beside the probe set's domains (a domain the choices were not made
on); the geometric mean stays the probe set's, `geometric_mean_all` takes the extras in too.
`--openings` (with --score) also scores where windows open: WINDOWS windows of OPENING_WINDOW tokens a domain at
offsets 0, 251, 502, ... (so they open on whatever token is there: '#', a quote, a word), each folder's mean
NLL over the parent's as a ratio, and how many windows collapse (more than COLLAPSE nats a token above the
parent's): a child that lost the attention sink for some first tokens collapses there (docs/refine.md).
`--smoke` runs the tiny embedded model at toy sizes (tests/test_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrated_merge import load_float32, loaded_perplexity  # noqa: E402

STAGES = {  # stage: RefineOptions keywords (None: the merge alone)
    "merge": None,
    "layerwise": {"global_steps": 0},
    "global": {},
}


WINDOWS, OPENING_WINDOW, OPENING_STEP, COLLAPSE = 16, 256, 251, 3.0


def probe_ids(model_dir: Path, tokens: int, extra: dict | None = None) -> dict:
    """The first `tokens` ids of every probe-set domain, then of each `extra` text ({name: path}), tokenized
    with the model's tokenizer."""
    import torch
    from transformers import AutoTokenizer

    from mha2gqa.corpus import textdata
    from mha2gqa.corpus.probe import probe_paths

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sets = {}
    for name, path in {**probe_paths(), **(extra or {})}.items():
        text = "".join(textdata.iter_texts(textdata.resolve("--data", [str(path)])))
        sets[name] = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:tokens])
    return sets


def domain_perplexities(model_dir: Path, sets: dict, context: int) -> dict:
    model = load_float32(model_dir)
    return {name: round(loaded_perplexity(model, ids, context), 3) for name, ids in sets.items()}


def geometric_mean(ratios: dict) -> float:
    return math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))


def summary(measured: dict, parent: dict) -> dict:
    """Ratios to the parent per domain, their geometric mean over the probe set's domains, and over all."""
    from mha2gqa.corpus.probe import DOMAINS

    ratios = {name: round(measured[name] / parent[name], 4) for name in measured}
    probe = {name: r for name, r in ratios.items() if name in DOMAINS}
    out = {"perplexity": measured, "ratio": ratios, "geometric_mean": round(geometric_mean(probe), 4)}
    if len(probe) < len(ratios):
        out["geometric_mean_all"] = round(geometric_mean(ratios), 4)
    return out


def window_nlls(model_dir: Path, sets: dict) -> dict:
    """Mean NLL of each of WINDOWS windows of OPENING_WINDOW tokens a domain, at offsets 0, OPENING_STEP, ..."""
    import torch

    model = load_float32(model_dir)
    out = {}
    with torch.no_grad():
        for name, ids in sets.items():
            starts = range(0, max(1, len(ids) - OPENING_WINDOW + 1), OPENING_STEP)
            windows = [ids[s : s + OPENING_WINDOW] for s in list(starts)[:WINDOWS]]
            nll = []
            for w in windows:
                log_probs = torch.log_softmax(model(w[None]).logits[0, :-1].float(), -1)
                nll.append(round(-float(log_probs.gather(1, w[1:, None]).mean()), 4))
            out[name] = nll
    return out


def openings_summary(child: dict, parent: dict) -> dict:
    """Per domain: exp(mean NLL difference) over the windows, how many collapse, and each window's difference
    (nats a token, in window order: which openings break)."""
    ratio, collapsed, gaps = {}, {}, {}
    for name, nll in child.items():
        raw = [c - p for c, p in zip(nll, parent[name], strict=True)]
        ratio[name] = round(math.exp(sum(raw) / len(raw)), 4)
        collapsed[name] = sum(gap > COLLAPSE for gap in raw)
        gaps[name] = [round(gap, 3) for gap in raw]
    windows = {n: len(v) for n, v in child.items()}
    return {"window_ratio": ratio, "collapsed": collapsed, "windows": windows, "gaps": gaps}


def calibration_rows(args, source: Path, work: Path, calibration: str, parent: dict, sets: dict) -> list[dict]:
    """One calibration: its text read (or sampled) and its statistics gathered once, then every stage
    converted from them (refine fits on the same ids: CalibrationStats.ids) and scored per domain."""
    import resource

    from mha2gqa.architecture.layouts import attention_shape, layout_for, read_config
    from mha2gqa.convert.calibration import calibrate
    from mha2gqa.convert.options import RefineOptions
    from mha2gqa.convert.run import convert

    config = read_config(source)
    spec = calibration.split("+")
    (work / "stats").mkdir()
    started = time.perf_counter()
    stats = calibrate(source, layout_for(config), attention_shape(config), spec, args.tokens, work / "stats")
    calibrate_s = time.perf_counter() - started
    rows = []
    for stage in args.stages:
        refine = None if STAGES[stage] is None else RefineOptions(**{**STAGES[stage], **args.refine})
        started = time.perf_counter()
        convert(source, work / stage, args.kv, method="calibrated", stats=stats, refine=refine, force=True, check=False)
        stage_s = time.perf_counter() - started
        measured = domain_perplexities(work / stage, sets, args.context)
        shutil.rmtree(work / stage)
        scores = summary(measured, parent)
        rows.append(
            {
                "calibration": calibration,
                "stage": stage,
                **scores,
                "worst": max(scores["ratio"], key=scores["ratio"].get),
                "calibrate_s": round(calibrate_s, 1),
                "stage_s": round(stage_s, 1),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "ids_sha256": stats.record["ids_sha256"],
                "sampling": stats.record.get("sampling"),  # the parent's recipe, where its samples are in the mix
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(work / "stats")
    return rows


def scored(args, result: dict, sets: dict) -> dict:
    """--score: each folder's perplexity ratio to the parent per domain, by the rows' own measure."""
    result["scored"] = []
    parent_windows = window_nlls(Path(args.model), sets) if args.openings else None
    for folder in args.score:
        measured = domain_perplexities(folder, sets, args.context)
        row = {"model": str(folder), **summary(measured, result["parent"])}
        if parent_windows is not None:
            row["openings"] = openings_summary(window_nlls(folder, sets), parent_windows)
        result["scored"].append(row)
        print(json.dumps(result["scored"][-1]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(result: dict) -> str:
    names = list(result["parent"])
    lines = ["| calibration | stage | " + " | ".join(names) + " | geo mean | calibrate | stage | peak RSS |"]
    lines.append("|---" * (len(names) + 6) + "|")
    for r in result["rows"]:
        cells = " | ".join(f"{r['ratio'][n]:.2f}x" for n in names)
        lines.append(
            f"| {r['calibration']} | {r['stage']} | {cells} | **{r['geometric_mean']:.2f}x** | "
            f"{r['calibrate_s'] / 60:.1f} min | {r['stage_s'] / 60:.1f} min | {r['peak_rss_mib'] / 1024:.2f} GiB |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="the parent model folder (omit with --smoke)")
    parser.add_argument("--kv", type=int, default=1, help="target kv heads")
    parser.add_argument("--calibrations", nargs="+", default=["austen", "parent", "parent:0.5+austen:0.5"])
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    parser.add_argument("--tokens", type=int, default=36864, help="calibration tokens of every calibration")
    parser.add_argument("--eval-tokens", type=int, default=4096, help="tokens of each probe domain")
    parser.add_argument("--context", type=int, default=512, help="perplexity window")
    parser.add_argument(
        "--refine", type=json.loads, default={}, help='RefineOptions keywords as JSON, e.g. {"steps": 1}'
    )
    parser.add_argument(
        "--sampling",
        type=json.loads,
        default={},
        help='SamplingRecipe keywords for the parent\'s samples as JSON, e.g. {"chat_share": 1.0}',
    )
    parser.add_argument(
        "--score",
        nargs="+",
        type=Path,
        help="only score these model folders (e.g. a conversion then uptrained) "
        "against MODEL, the same way as the rows: no conversion",
    )
    parser.add_argument(
        "--extra", nargs="+", default=[], metavar="NAME=PATH", help="more texts to score beside the probe set"
    )
    parser.add_argument("--openings", action="store_true", help="with --score: also score where windows open")
    parser.add_argument("--out", type=Path, help="JSON file for the result")
    parser.add_argument("--smoke", action="store_true", help="the embedded model at toy sizes")
    args = parser.parse_args(argv)
    if args.smoke:
        from mha2gqa.files.embedded import MODEL_DIR

        args.model, args.kv, args.tokens, args.eval_tokens, args.context = str(MODEL_DIR), 4, 1024, 256, 128
        args.calibrations, args.stages = ["austen", "parent:0.5+austen:0.5"], ["merge", "global"]
        args.refine = {"steps": 1, "tokens": 512}
    if args.sampling:  # every sampling below reads the module's default recipe when called
        from mha2gqa.corpus import sampling

        sampling.DEFAULT_RECIPE = sampling.SamplingRecipe(**args.sampling)
    source = Path(args.model)
    extra = dict(entry.split("=", 1) for entry in args.extra)
    sets = probe_ids(source, args.eval_tokens, extra)
    parent = domain_perplexities(source, sets, args.context)
    result = {"model": str(source), "kv_heads": args.kv, "tokens": args.tokens, "parent": parent, "rows": []}
    result.update(eval_tokens={n: len(ids) for n, ids in sets.items()}, context=args.context)
    print(f"parent: {parent}; load {os.getloadavg()}", flush=True)
    if args.score:
        return scored(args, result, sets)
    for calibration in args.calibrations:
        with tempfile.TemporaryDirectory(prefix="calibration-domains-") as work:
            result["rows"] += calibration_rows(args, source, Path(work), calibration, parent, sets)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
