"""Measurement: the global stage of `--refine` (convert/refine/global_stage.py) on a real model, several settings from one
layer-wise refined start (issue 20), so each setting costs only its own global stage.

    python -m mha2gqa convert PARENT REFINED --groups 1 --method calibrated --calibration austen --refine \
        --refine-global-steps 0
    python bench/refine_global_real.py PARENT REFINED --variants "steps=24 lr=1e-4;steps=24 lr=3e-4 clip=0" \
        --out OUT.json [--save-best DIR]

REFINED: a `convert --refine --refine-global-steps 0` output of PARENT (the layer-wise stage alone). The
calibration blocks and their fit / held-out split are rebuilt exactly as that conversion made them (its
mha2gqa.json: data, calibration tokens and their hash, refine tokens), and the global stage trains what
`--refine` hands it: the attention parameters of every layer whose layer-wise refit was kept.
A variant: steps=N lr=X [batch_blocks=4] [clip=1.0] [beta2=0.95] [decay=0]; the defaults are the
package's, clip=0 is none and decay=1 a cosine to 0 after the warmup. Variants are separated by ';' and
each is trained from REFINED's weights. Per variant: the held-out KL checks, wall and CPU seconds of the
stage, perplexity on Persuasion and on the Python Language Reference (as bench/refine_real.py).
--save-best writes the variant with the lowest Persuasion perplexity as a checkpoint (with PARENT's
tokenizer), for uptraining from it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrated_merge import load_float32, loaded_perplexity  # noqa: E402
from refine_real import eval_sets  # noqa: E402

from mha2gqa.architecture.layouts import layout_for, read_config  # noqa: E402
from mha2gqa.convert.inputs import RefineBudget, block_length  # noqa: E402
from mha2gqa.convert.options import REFINE_TOKENS_PER_HIDDEN  # noqa: E402
from mha2gqa.convert.refine import EXACT, GlobalFit, calibration_blocks, fit_global  # noqa: E402
from mha2gqa.corpus.calibration import read_calibration, resolve_calibration  # noqa: E402
from mha2gqa.records.provenance import latest  # noqa: E402


def trained_parameters(model, config: dict, refine: dict) -> list[torch.nn.Parameter]:
    """The attention parameters of every layer whose layer-wise refit was kept (what --refine's global stage
    trains): fitted (not exact) and not kept as merged."""
    layout = layout_for(config)
    fitted = [r["layer"] for r in refine["layers"] if r["fit_error_before"] > EXACT and "kept_merged" not in r]
    attention = layout.o.rsplit(".", 1)[0]  # the parent of o_proj, relative to the layer (self_attn in every layout)
    return [
        p
        for index in fitted
        for p in model.get_submodule(layout.layer_prefix.format(layer=index).rstrip("."))
        .get_submodule(attention)
        .parameters()
    ]


def variant(text: str) -> dict:
    """'steps=24 lr=1e-4 [batch_blocks=4] [clip=1] [beta2=0.95] [decay=0]' -> GlobalFit's keyword arguments."""
    fields = dict(item.split("=") for item in text.split())
    setting = {"steps": int(fields.pop("steps")), "lr": float(fields.pop("lr"))}
    setting["batch_blocks"] = int(fields.pop("batch_blocks", 4))
    setting["clip"] = float(fields.pop("clip", 1.0))
    setting["betas"] = (0.9, float(fields.pop("beta2", 0.95)))
    setting["decay"] = fields.pop("decay", "0") == "1"
    if fields:
        sys.exit(f"Error: unknown variant fields {sorted(fields)} in {text!r}")
    return setting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parent")
    parser.add_argument("refined")
    parser.add_argument("--variants", default="steps=20 lr=1e-4", help="VARIANT;VARIANT;... (see above)")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-best", default=None)
    args = parser.parse_args()
    parent_dir, refined_dir = Path(args.parent), Path(args.refined)
    record = latest(refined_dir, "conversion")
    calibration, refine = record["calibration"], record["refine"]
    if refine.get("global"):
        sys.exit(f"Error: {refined_dir} already went through the global stage; convert with --refine-global-steps 0")
    config = read_config(refined_dir)
    data = resolve_calibration(
        calibration["data"], calibration.get("tokens_requested", calibration["tokens"]), block_length(config)
    )
    seed = calibration.get("sampling", {}).get("seed", 0)
    ids, _ = read_calibration(data, parent_dir, seed, lambda: load_float32(parent_dir))
    if hashlib.sha256(ids.numpy().tobytes()).hexdigest() != calibration["ids_sha256"]:
        sys.exit(f"Error: the calibration text of {refined_dir} tokenizes differently here: not the same blocks")
    hidden = config["hidden_size"]
    budget = RefineBudget(block_length(config), refine["options"]["tokens"] or REFINE_TOKENS_PER_HIDDEN * hidden)
    blocks, split = calibration_blocks(ids, budget)
    sets = eval_sets(parent_dir, args.eval_tokens)
    parent, start = (load_float32(d).requires_grad_(False) for d in (parent_dir, refined_dir))
    kept = {name: t.clone() for name, t in start.state_dict().items()}

    def perplexities(model) -> dict:
        return {name: loaded_perplexity(model, ids, args.context) for name, ids in sets.items()}

    result = {
        "parent": str(parent_dir),
        "refined": str(refined_dir),
        "fit_blocks": len(split["fit"]),
        "heldout_blocks": len(split["heldout"]),
        "load_average_start": os.getloadavg(),
        "parent_perplexity": perplexities(parent),
        "start_perplexity": perplexities(start),
        "rows": [],
    }
    print(json.dumps({k: result[k] for k in ("parent_perplexity", "start_perplexity")}), flush=True)
    best = None
    for text in args.variants.split(";"):
        setting = variant(text)
        start.load_state_dict(kept)
        params = trained_parameters(start, config, refine)
        began, began_cpu = time.perf_counter(), time.process_time()
        generator = torch.Generator().manual_seed(refine["options"]["seed"])
        checks = fit_global(parent, start, params, blocks, split, GlobalFit(**setting), generator, progress=True)
        row = {
            **setting,
            "wall_s": round(time.perf_counter() - began, 1),
            "cpu_s": round(time.process_time() - began_cpu, 1),
            "record": checks,
            "perplexity": perplexities(start),
            "load_average": os.getloadavg(),
        }
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "record"} | {"best_step": checks["best_step"]}))
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        if args.save_best and (best is None or row["perplexity"]["persuasion"] < best):
            from transformers import AutoTokenizer

            best = row["perplexity"]["persuasion"]
            start.save_pretrained(args.save_best)
            AutoTokenizer.from_pretrained(parent_dir).save_pretrained(args.save_best)
            (Path(args.save_best) / "global-variant.json").write_text(json.dumps(setting) + "\n")


if __name__ == "__main__":
    main()
