"""`mha2gqa reproduce`: the GQA paper's ablations at small scale, on the embedded default.

Grid: conversion method x target kv heads x uptraining budget alpha (a fraction of the parent's
pretraining tokens). Each (method, kv heads) cell is ONE uptraining run with a constant learning rate
(after a short warm-up), evaluated on held-out Persuasion at every alpha of the grid: with a constant
rate, the run's prefix up to alpha is exactly the shorter run, so one run serves every alpha. (The
paper trained separate runs; we say so in the docs.) Every number comes from the uptrain loop's own
evaluation (mean token NLL over fixed held-out blocks), so parent, converted and uptrained models are
measured identically.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from mha2gqa import embedded
from mha2gqa.demo import DEMO_RECIPE, embedded_run_overrides
from mha2gqa.errors import InputError

METHODS = ("mean", "first", "random")
KV_HEADS = (1, 2, 4)
ALPHAS = (0.0, 0.025, 0.05, 0.1)


def _overrides(model: Path, out: Path, eval_blocks: int) -> list[str]:
    return embedded_run_overrides(model, out, eval_blocks) + [
        "optim.schedule=constant", "eval_at_start=true", "budget.alpha=null", "budget.pretrain_tokens=null",
        "log_every=1000000", "save_every=1000000", "overwrite=true"]


def _evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("eval_ppl") is not None]


def run_grid(out: Path, methods=METHODS, kv_heads=KV_HEADS, alphas=ALPHAS, eval_blocks: int = 32,
             echo: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Run the grid into `out` (work files under out/work are removed at the end); returns the table."""
    from mha2gqa.convert.run import convert
    from mha2gqa.uptrain import load_recipe, train

    parent = embedded.model_dir()
    pretrain = embedded.pretrain_tokens()
    positive = sorted(a for a in alphas if a > 0)
    if not positive or min(alphas) < 0:
        raise InputError(f"--alphas {alphas}: give non-negative fractions with at least one above 0, e.g. 0,0.05")
    recipe_base = load_recipe(DEMO_RECIPE, _overrides(parent, out / "work" / "parent", eval_blocks) + ["budget.max_steps=1"])
    tokens_per_step = recipe_base.seq_len * recipe_base.micro_batch_size * recipe_base.grad_accum
    # Evaluations happen every `unit` steps, so every alpha is rounded to a multiple of the smallest.
    unit = max(1, round(positive[0] * pretrain / tokens_per_step))
    step_of = {a: round(a / positive[0]) * unit for a in alphas}
    work = out / "work"
    rows = []

    def measure(model: Path, name: str, steps: int, method: str, kv: int) -> None:
        recipe = load_recipe(DEMO_RECIPE, _overrides(model, work / name, eval_blocks)
                             + [f"budget.max_steps={max(steps, 1)}", f"eval_every={unit}"])
        train(recipe)
        evals = {row["step"]: row for row in _evals(work / name)}
        for alpha, step in step_of.items():
            if step in evals and (steps or step == 0):
                rows.append({"method": method, "kv_heads": kv, "alpha": alpha, "step": step,
                             "alpha_exact": step * tokens_per_step / pretrain,
                             "tokens": step * tokens_per_step, "eval_loss": evals[step]["eval_loss"],
                             "perplexity": evals[step]["eval_ppl"]})

    info = json.loads((parent / "config.json").read_text())
    measure(parent, "parent", 0, "parent (MHA)", info.get("num_key_value_heads", info["num_attention_heads"]))
    echo(f"parent perplexity on held-out Persuasion: {rows[-1]['perplexity']:.2f}")
    for method in methods:
        for kv in kv_heads:
            converted = work / f"{method}-kv{kv}-converted"
            convert(parent, converted, groups=kv, method=method, force=True, progress=False)
            measure(converted, f"{method}-kv{kv}", max(step_of.values()), method, kv)
            shutil.rmtree(converted)
            cell = [r for r in rows if r["method"] == method and r["kv_heads"] == kv]
            echo(f"{method:>6} kv={kv}: " + "  ".join(f"alpha={r['alpha']:g}: {r['perplexity']:.2f}" for r in cell))
    shutil.rmtree(work)
    table = {"parent": str(parent), "pretrain_tokens": pretrain, "tokens_per_step": tokens_per_step,
             "eval": f"{eval_blocks} held-out blocks of {recipe_base.seq_len} tokens of Persuasion", "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablations.json").write_text(json.dumps(table, indent=2) + "\n")
    return table
