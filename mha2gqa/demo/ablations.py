"""`mha2gqa reproduce`: the GQA paper's ablations at small scale, on the embedded default, and what
it writes (ablations.json, ablations.md, perplexity_vs_alpha.png, quality_vs_kv.png).

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
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.architecture.layouts import head_counts, read_config
from mha2gqa.demo.pipeline import DEMO_RECIPE, embedded_run_overrides
from mha2gqa.files import embedded, jsontext
from mha2gqa.files.run_folder import run_folder, validate_folder
from mha2gqa.runtime.errors import InputError

ABLATION_METHODS = ("mean", "first", "random")  # the paper's ablations
MARKERS = {"mean": "o", "first": "s", "random": "^"}  # plot markers per method
KV_HEADS = (1, 2, 4)
ALPHAS = (0.0, 0.025, 0.05, 0.1)
# What a reproduce run writes into --out (run_folder's rule: anything else there is the user's).
RUN_ENTRIES = frozenset({"ablations.json", "ablations.md", "perplexity_vs_alpha.png", "quality_vs_kv.png", "work"})


@dataclass(frozen=True)
class ReproducePlan:
    """A checked reproduce request (plan_reproduce): the grid and where it goes."""

    out: Path
    methods: tuple[str, ...]
    kv_heads: tuple[int, ...]
    alphas: tuple[float, ...]
    eval_blocks: int
    force: bool = False

    def describe(self) -> list[str]:
        cells = len(self.methods) * len(self.kv_heads)
        return [
            f"would write ablations.json, ablations.md and two plots into {self.out}",
            f"  {cells} uptraining runs (methods {', '.join(self.methods)} x kv heads "
            f"{', '.join(map(str, self.kv_heads))}), each evaluated at alpha {', '.join(f'{a:g}' for a in self.alphas)}",
            f"  every evaluation on {self.eval_blocks} held-out 512-token blocks of Persuasion",
        ]


def _listed(values) -> str:
    values = [str(v) for v in values]
    return ", ".join(values[:-1]) + f" or {values[-1]}" if len(values) > 1 else values[0]


def plan_reproduce(
    out: Path, methods=ABLATION_METHODS, kv_heads=KV_HEADS, alphas=ALPHAS, eval_blocks: int = 32, force: bool = False
) -> ReproducePlan:
    """Every check of a reproduce request, torch-free and before anything is written, each in the words
    of its own flag."""
    methods, kv_heads, alphas = tuple(dict.fromkeys(methods)), tuple(dict.fromkeys(kv_heads)), tuple(alphas)
    if not methods or (unknown := [m for m in methods if m not in ABLATION_METHODS]):
        given = ",".join(unknown) if methods else "(nothing)"
        raise InputError(f"--methods {given}: each must be one of {_listed(ABLATION_METHODS)}, e.g. mean,first")
    valid = head_counts(read_config(embedded.model_dir()))[1]
    divisors = [g for g in range(1, valid + 1) if valid % g == 0]
    if not kv_heads or (wrong := [g for g in kv_heads if g not in divisors]):
        given = ",".join(map(str, wrong)) if kv_heads else "(nothing)"
        raise InputError(
            f"--kv-heads {given}: each must divide the embedded model's {valid} kv heads (valid: {_listed(divisors)})"
        )
    if not alphas or any(not math.isfinite(a) or not 0 <= a <= 1 for a in alphas):
        raise InputError(
            f"--alphas {','.join(f'{a:g}' for a in alphas) or '(nothing)'}: each must be a fraction in [0, 1], "
            "e.g. 0,0.025,0.05"
        )
    if 0 not in alphas or max(alphas) == 0:
        raise InputError(
            f"--alphas {','.join(f'{a:g}' for a in alphas)} must hold 0 (the converted model before uptraining, "
            "the grid's first column) and a budget above it, e.g. 0,0.05"
        )
    if eval_blocks < 1:
        raise InputError(f"--eval-blocks {eval_blocks} must be at least 1 (e.g. 32)")
    out = validate_folder(out, "--out", "reproduce", RUN_ENTRIES, force)
    return ReproducePlan(out, methods, kv_heads, tuple(sorted(set(alphas))), eval_blocks, force)


def _overrides(model: Path, out: Path, eval_blocks: int) -> list[str]:
    return embedded_run_overrides(model, out, eval_blocks) + [
        "optim.schedule=constant",
        "eval_at_start=true",
        "budget.alpha=null",
        "budget.pretrain_tokens=null",
        "log_every=1000000",
        "save_every=1000000",
        "overwrite=true",
    ]


def _evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("eval_ppl") is not None]


@dataclass(frozen=True)
class _Schedule:
    """When the grid's runs are evaluated: every `unit` optimizer steps, alpha `a` at step `step_of[a]`."""

    pretrain: int  # the parent's pretraining tokens
    tokens_per_step: int
    seq_len: int
    unit: int
    step_of: dict[float, int]


def _schedule(parent: Path, work: Path, plan: ReproducePlan) -> _Schedule:
    from mha2gqa.uptrain import load_recipe

    pretrain = embedded.pretrain_tokens()
    positive = sorted(a for a in plan.alphas if a > 0)  # plan_reproduce checked: 0 and one above it
    base = load_recipe(DEMO_RECIPE, _overrides(parent, work / "parent", plan.eval_blocks) + ["budget.max_steps=1"])
    tokens_per_step = base.seq_len * base.micro_batch_size * base.grad_accum
    # Evaluations happen every `unit` steps, so every alpha is rounded to a multiple of the smallest.
    unit = max(1, round(positive[0] * pretrain / tokens_per_step))
    step_of = {a: round(a / positive[0]) * unit for a in plan.alphas}
    return _Schedule(pretrain, tokens_per_step, base.seq_len, unit, step_of)


def _measure(
    model: Path, run_dir: Path, steps: int, method: str, kv: int, schedule: _Schedule, eval_blocks: int
) -> list[dict]:
    """Uptrain `model` for `steps` (0: evaluate it only) into `run_dir`, evaluated on the schedule; one row
    for each alpha the run reached."""
    from mha2gqa.uptrain import load_recipe, train

    recipe = load_recipe(
        DEMO_RECIPE,
        _overrides(model, run_dir, eval_blocks) + [f"budget.max_steps={max(steps, 1)}", f"eval_every={schedule.unit}"],
    )
    train(recipe)
    evals = {row["step"]: row for row in _evals(run_dir)}
    return [
        {
            "method": method,
            "kv_heads": kv,
            "alpha": alpha,
            "step": step,
            "alpha_exact": step * schedule.tokens_per_step / schedule.pretrain,
            "tokens": step * schedule.tokens_per_step,
            "eval_loss": evals[step]["eval_loss"],
            "perplexity": evals[step]["eval_ppl"],
        }
        for alpha, step in schedule.step_of.items()
        if step in evals and (steps or step == 0)
    ]


def run_grid(out: Path, plan: ReproducePlan, echo: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Run the grid of `plan` into `out` (work files under out/work are removed at the end); returns the table."""
    from mha2gqa.convert.run import convert

    parent, work = embedded.model_dir(), out / "work"
    schedule = _schedule(parent, work, plan)
    kv_parent = head_counts(read_config(parent))[1]
    rows = _measure(parent, work / "parent", 0, "parent (MHA)", kv_parent, schedule, plan.eval_blocks)
    echo(f"parent perplexity on held-out Persuasion: {rows[-1]['perplexity']:.2f}")
    for method in plan.methods:
        for kv in plan.kv_heads:
            converted = work / f"{method}-kv{kv}-converted"
            convert(parent, converted, groups=kv, method=method, force=True, progress=False, check=False)
            steps = max(schedule.step_of.values())
            cell = _measure(converted, work / f"{method}-kv{kv}", steps, method, kv, schedule, plan.eval_blocks)
            shutil.rmtree(converted)
            rows += cell
            echo(f"{method:>6} kv={kv}: " + "  ".join(f"alpha={r['alpha']:g}: {r['perplexity']:.2f}" for r in cell))
    shutil.rmtree(work)
    table = {
        "parent": str(parent),
        "pretrain_tokens": schedule.pretrain,
        "tokens_per_step": schedule.tokens_per_step,
        "eval": f"{plan.eval_blocks} held-out blocks of {schedule.seq_len} tokens of Persuasion",
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablations.json").write_text(jsontext.dumps(table, indent=2) + "\n")
    return table


def markdown_table(table: dict) -> str:
    rows = table["rows"]
    alphas = sorted({r["alpha"] for r in rows if not r["method"].startswith("parent")})
    parent = next(r for r in rows if r["method"].startswith("parent"))
    head = "| method | kv heads | " + " | ".join(f"alpha={a:g}" for a in alphas) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(alphas)]
    lines.append(
        f"| parent (MHA) | {parent['kv_heads']} | {parent['perplexity']:.2f}" + " |" + " |" * (len(alphas) - 1)
    )
    cells = sorted({(r["method"], r["kv_heads"]) for r in rows if r is not parent}, key=lambda c: (c[0] != "mean", c))
    for method, kv in cells:
        by_alpha = {r["alpha"]: r["perplexity"] for r in rows if (r["method"], r["kv_heads"]) == (method, kv)}
        values = " | ".join(f"{by_alpha[a]:.2f}" if a in by_alpha else "" for a in alphas)
        lines.append(f"| {method} | {kv} | {values} |")
    exact = sorted({(r["alpha"], r["alpha_exact"]) for r in rows if r is not parent and "alpha_exact" in r})
    note = ", ".join(f"{a:g} = {100 * e:.2f}%" for a, e in exact)
    lines += ["", f"Held-out perplexity ({table['eval']}). Alphas as run (whole optimizer steps): {note}."]
    return "\n".join(lines) + "\n"


def plot(table: dict, out_dir: Path, kv_bytes_per_head: int, dtype: str = "float32") -> list[Path]:
    """perplexity_vs_alpha.png (one panel per kv-head count) and quality_vs_kv.png; kv_bytes_per_head is
    one kv head's K and V over all layers, per token, in the parent's `dtype`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table["rows"] if not r["method"].startswith("parent")]
    parent = next(r for r in table["rows"] if r["method"].startswith("parent"))
    kvs = sorted({r["kv_heads"] for r in rows})
    methods = sorted({r["method"] for r in rows}, key=lambda m: list(MARKERS).index(m) if m in MARKERS else 9)
    fig, axes = plt.subplots(1, len(kvs), figsize=(4.2 * len(kvs), 3.8), sharey=True, squeeze=False)
    for ax, kv in zip(axes[0], kvs):
        for method in methods:
            cell = sorted((r["alpha"], r["perplexity"]) for r in rows if r["method"] == method and r["kv_heads"] == kv)
            ax.plot([100 * a for a, _ in cell], [p for _, p in cell], marker=MARKERS.get(method, "x"), label=method)
        ax.axhline(parent["perplexity"], color="gray", linestyle="--", label="parent (MHA)")
        ax.set_title(f"{kv} kv head{'s' if kv > 1 else ''}")
        ax.set_xlabel("uptraining alpha (% of pretraining tokens)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("held-out perplexity (log scale)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    first = out_dir / "perplexity_vs_alpha.png"
    fig.savefig(first, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.2))
    alphas = sorted({r["alpha"] for r in rows})
    for alpha in alphas:
        points = sorted(
            (r["kv_heads"] * kv_bytes_per_head, r["perplexity"])
            for r in rows
            if r["alpha"] == alpha and r["method"] == "mean"
        )
        ax.plot([x / 1024 for x, _ in points], [p for _, p in points], marker="o", label=f"mean, alpha={alpha:g}")
    ax.scatter(
        [parent["kv_heads"] * kv_bytes_per_head / 1024],
        [parent["perplexity"]],
        color="black",
        marker="*",
        s=120,
        label="parent (MHA)",
        zorder=3,
    )
    ax.set_xlabel(f"KV cache per token (KiB, {dtype})")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    second = out_dir / "quality_vs_kv.png"
    fig.savefig(second, dpi=120)
    plt.close(fig)
    return [first, second]


def write_ablations(table: dict, out: Path) -> dict:
    """ablations.md and the two plots beside ablations.json; returns every path written. KV bytes come
    from the parent's config (layers, head_dim, dtype), as `mha2gqa inspect` computes them."""
    from mha2gqa.architecture.layouts import attention_shape, read_config

    out = Path(out)
    shape = attention_shape(read_config(table["parent"]))
    (out / "ablations.md").write_text(markdown_table(table))
    first, second = plot(table, out, kv_bytes_per_head=shape.kv_bytes_per_token(kv_heads=1), dtype=shape.dtype)
    return {
        "json": out / "ablations.json",
        "markdown": out / "ablations.md",
        "perplexity_vs_alpha": first,
        "quality_vs_kv": second,
    }


def reproduce(
    out: Path,
    methods=ABLATION_METHODS,
    kv_heads=KV_HEADS,
    alphas=ALPHAS,
    eval_blocks: int = 32,
    echo: Callable[[str], None] = print,
    progress: bool = True,
    force: bool = False,
    plan: ReproducePlan | None = None,
) -> tuple[dict, dict]:
    """`mha2gqa reproduce`: check the request (plan_reproduce, unless `plan` is given), then run the grid
    into `out` and write its table and plots; (table, paths). OUT follows the rule of every output folder:
    an earlier run is replaced only with `force`, and a failed run leaves what was there."""
    plan = plan or plan_reproduce(out, methods, kv_heads, alphas, eval_blocks, force)
    with run_folder(plan.out, "--out", "reproduce", RUN_ENTRIES, plan.force) as folder:
        table = run_grid(folder.path, plan, echo, progress)
        return table, write_ablations(table, folder.path)
