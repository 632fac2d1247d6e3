"""The report's PNG plots: quality vs KV bytes, decode tokens/s vs batch, the training curve."""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from mha2gqa.eval import schema  # noqa: E402
from mha2gqa.eval.metrics import Table, speedup_at, tokens_per_s_iqr  # noqa: E402
from mha2gqa.files.reading import MAX_JSON_BYTES, did_you_mean, parse_json_lines, read_bytes  # noqa: E402
from mha2gqa.records import provenance  # noqa: E402
from mha2gqa.report import measured_on  # noqa: E402
from mha2gqa.runtime.errors import InputError  # noqa: E402
from mha2gqa.runtime.units import byte_unit  # noqa: E402

ROLE_COLORS = {"parent": "#1f77b4", "converted": "#d62728", "uptrained": "#2ca02c"}
ROLE_MARKERS = {"parent": "o", "converted": "s", "uptrained": "^"}
DPI = 120


def _axis_unit(values: list[float]) -> tuple[float, str]:
    """A divisor and unit that keep the largest value between 1 and 1024."""
    div, unit = byte_unit(max(values), largest="MiB")
    return div, "bytes" if div == 1 else unit


def _save(fig, out: Path) -> Path:
    """The figure as a PNG; its footnotes (fig.text, placed at the bottom edge) get a strip of their own below the
    axes (placed outside the figure, they were cut off)."""
    fig.tight_layout(rect=(0, 0.07 * len(fig.texts), 1, 1) if fig.texts else None)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def quality_vs_kv(rows: list[dict], out: Path, subtitle: str = "") -> Path | None:
    """Perplexity against KV-cache bytes per token, one labelled point per result."""
    pts = [r for r in rows if r["perplexity"] is not None and r["kv_bytes_per_token"] is not None]
    if not pts:
        return None
    div, unit = _axis_unit([r["kv_bytes_per_token"] for r in pts])
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    stacked: dict[tuple, int] = {}  # labels of points at the same place go one above the other
    for r in pts:
        x, y = r["kv_bytes_per_token"] / div, r["perplexity"]
        at = (round(x, 6), round(y, 6))
        stacked[at] = stacked.get(at, -1) + 1
        ax.scatter(
            x,
            y,
            s=70,
            color=ROLE_COLORS.get(r["role"], "gray"),
            marker=ROLE_MARKERS.get(r["role"], "o"),
            alpha=0.8,
            zorder=3,
        )
        ax.annotate(
            f"{r['label']} ({r['kv_heads']} kv)",
            (x, y),
            textcoords="offset points",
            xytext=(8, 6 + 13 * stacked[at]),
            fontsize=9,
        )
    for role, color in ROLE_COLORS.items():
        if any(r["role"] == role for r in pts):
            ax.scatter([], [], color=color, marker=ROLE_MARKERS[role], label=role)
    ax.set_xlabel(f"KV cache per token ({unit})")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("Quality vs KV-cache size" + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.margins(x=0.25, y=0.2)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    return _save(fig, out)


def speed_vs_batch(results: list[dict], out: Path, base: int = 0, speedup_apart: bool = False) -> Path | None:
    """The PNG of speed_figure, None when it draws nothing."""
    fig = speed_figure(results, base, speedup_apart)
    return None if fig is None else _save(fig, out)


def speed_figure(results: list[dict], base: int = 0, speedup_apart: bool = False):
    """What the table says about decode speed, per batch and context. Against a baseline: each model's
    speed-up over the baseline timed side by side with it (report --speedup-apart: apart too, marked), with
    its ~95% range; a range that holds 1 is drawn hollow and labelled noise, as the table calls it. A speed
    timed in a separate run is not drawn against another (two loads, not two models: the demo's plot showed
    the uptrained model 335 tok/s against the parent's 501 while its table called the gap noise). A single
    result with speeds gets its own tokens/s (median, IQR bars); None when nothing can be drawn."""
    measured = [i for i, r in enumerate(results) if schema.speed_points(r)]
    if not measured:
        return None
    table = Table(results, base, None, [None] * len(results), speedup_apart)
    points = {(p["batch"], p["context"]) for i in measured for p in results[i]["speed"]["points"]}
    pairs = {
        i: {point: found for point in points if (found := speedup_at(table, i, point))} for i in measured if i != base
    }
    if any(pairs.values()):
        return _speedup_figure(results, base, {i: found for i, found in pairs.items() if found}, sorted(points))
    if len(measured) == 1:
        return _absolute_figure(results[measured[0]])
    return None


def _speedup_figure(results: list[dict], base: int, pairs: dict, points: list[tuple[int, int]]):
    contexts = sorted({context for _, context in points})
    batches = sorted({batch for batch, _ in points})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        ax.axhline(1.0, color="gray", lw=1, ls="--", label=f"{results[base]['label']} (baseline)")
        for n, (i, found) in enumerate(sorted(pairs.items())):
            _speedup_points(
                ax, results[i], [(b, found[(b, c)]) for b, c in points if c == context and (b, c) in found], n
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_xlabel("batch size (sequences, log scale)")
        ax.set_ylabel(f"decode speed-up vs {results[base]['label']} (×)")
        ax.set_title(f"Greedy decode, context {context} tokens", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    left_out = [r["label"] for i, r in enumerate(results) if i != base and i not in pairs and schema.speed_points(r)]
    words = "bars: ~95% range from the timed repeats; hollow: the range holds 1 (noise, no speed-up claimed)"
    if left_out:
        words += f"; not drawn, timed apart from the baseline: {', '.join(left_out)}"
    fig.text(0.01, 0.01, words, fontsize=8, ha="left", va="bottom", wrap=True)
    return fig


def _speedup_points(ax, r: dict, found: list[tuple[int, dict]], n: int) -> None:
    """One model's speed-ups at one context: filled where they are claimed, hollow and labelled noise where
    their range holds 1; a speed-up from speeds timed apart (--speedup-apart) dashed."""
    if not found:
        return
    color = f"C{n % 10}"
    apart = any(s["measured"] == "apart" for _, s in found)
    label = f"{r['label']} ({r['model']['kv_heads']} kv)" + (", timed apart (--speedup-apart)" if apart else "")
    batch = [b for b, _ in found]
    ax.plot(batch, [s["speedup"] for _, s in found], color=color, ls="--" if apart else "-", lw=1, label=label)
    for b, s in found:
        low, high = (s["low"], s["high"]) if s["low"] is not None else (s["speedup"], s["speedup"])
        ax.errorbar(
            [b],
            [s["speedup"]],
            yerr=[[s["speedup"] - low], [high - s["speedup"]]],
            marker="o",
            color=color,
            mfc="white" if s["noisy"] else color,
            capsize=4,
        )
        if s["noisy"]:
            ax.annotate(
                "noise", (b, s["speedup"]), textcoords="offset points", xytext=(6, -10), fontsize=8, color=color
            )


def _absolute_figure(r: dict):
    """One model's decode tokens/s against batch size, one panel per context length: the median of the timed
    repeats, with bars over their interquartile range (so one slow or fast repeat moves neither the line nor
    the axis). Nothing is compared, so nothing timed apart is set beside it."""
    contexts = sorted({p["context"] for p in r["speed"]["points"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    left_out: list[str] = []
    for ax, context in zip(axes[0], contexts):
        left_out += _speed_line(ax, r, context)
        batches = sorted({p["batch"] for p in r["speed"]["points"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch size (sequences, log scale)")
        ax.set_ylabel("decode tokens/s (median; bars: IQR of repeats)")
        ax.set_title(f"Greedy decode, context {context} tokens")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=9)
    if left_out:
        fig.text(
            0.01, 0.01, "IQR bar left out (median outside its IQR): " + ", ".join(left_out), fontsize=8, va="bottom"
        )
    return fig


def _speed_line(ax, r: dict, context: int) -> list[str]:
    """One result's medians at `context` with their interquartile bars; returns the points whose bar was left
    out: a median outside its own interquartile range (an edited or inconsistent file) has no bar to draw,
    so its point is drawn alone (matplotlib refuses a negative error bar) and the figure says so."""
    pts = sorted(
        ((p["batch"], p["tokens_per_s"], tokens_per_s_iqr(p)) for p in r["speed"]["points"] if p["context"] == context),
        key=lambda point: point[0],
    )
    if not pts:
        return []
    batch, median, iqr = zip(*pts)
    inside = [not q or q[0] <= m <= q[1] for m, q in zip(median, iqr)]
    bars = [q if q and ok else (m, m) for m, q, ok in zip(median, iqr, inside)]
    below = [m - q[0] for m, q in zip(median, bars)]
    above = [q[1] - m for m, q in zip(median, bars)]
    ax.errorbar(
        batch, median, yerr=[below, above], marker="o", capsize=4, label=f"{r['label']} ({r['model']['kv_heads']} kv)"
    )
    return [f"{r['label']} B={b} T={context}" for b, ok in zip(batch, inside) if not ok]


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not os.path.lexists(path):
        raise InputError(
            f"--metrics {path}: no such file{did_you_mean(path)} (uptraining writes metrics.jsonl in its output_dir)"
        )
    fix = "pass the uptrain metrics.jsonl"
    raw = parse_json_lines(read_bytes(path, MAX_JSON_BYTES, kind="metrics"), f"--metrics {path}", fix)
    rows = []
    for n, row in raw:
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)) or isinstance(row["step"], bool):
            raise InputError(f"--metrics {path} line {n} is not an object with a numeric 'step': {fix}")
        rows.append(row)
    if not rows:
        raise InputError(f"--metrics {path} has no lines with a 'step': pass the uptrain metrics.jsonl")
    if not (_series(rows, "loss") or _series(rows, "ppl")):
        raise InputError(
            f"--metrics {path} has no numeric loss or ppl keys (keys: {', '.join(sorted(rows[0]))}): "
            "pass the uptrain metrics.jsonl"
        )
    return rows


def _series(rows: list[dict], word: str) -> dict[str, list[tuple[float, float]]]:
    """Every numeric key containing `word`, as (step, value) pairs; nulls and NaNs skipped."""
    out: dict[str, list] = {}
    for r in rows:
        for key, value in r.items():
            if word in key and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out.setdefault(key, []).append((r["step"], value))
    return out


def training_objective(metrics_path: Path) -> str:
    """What the logged train `loss` is, from the run's recipe in its mha2gqa.json when there is one:
    the LM loss, or distillation's mix of the LM loss and the KL to the teacher."""
    try:
        stage = provenance.latest(Path(metrics_path).parent, "uptrain")
    except InputError:
        stage = None
    recipe = (stage or {}).get("recipe") or {}
    if not recipe:
        return "train loss (LM loss, mixed with KL to the teacher when the recipe distils)"
    distill = recipe.get("distill") or {}
    if distill.get("teacher"):
        w, t = distill.get("kl_weight", 0.5), distill.get("temperature", 1.0)
        return f"train objective: {1 - w:g}·LM + {w:g}·T²·KL(teacher‖model), T={t:g}"
    return "train LM loss (training batches)"


# Characters of a panel title's line in the training curve: a 6-inch panel at font size 10 holds about 70, and
# a longer line ran past the figure's edge (the held-out panel's "measured on ..." line was cut off).
TITLE_CHARS = 60


def _wrapped(lines: list[str]) -> str:
    """The non-empty lines, each broken at spaces into lines of at most TITLE_CHARS."""
    return "\n".join(part for line in lines if line for part in textwrap.wrap(line, TITLE_CHARS))


def training_curve(metrics_path: Path, out: Path) -> Path:
    """The PNG of training_figure."""
    return _save(training_figure(metrics_path), out)


def training_figure(metrics_path: Path):
    """Two panels that each hold one kind of number: the training objective per optimizer step (which
    may mix in distillation's KL), and the held-out LM perplexity at each eval."""
    rows = read_metrics(metrics_path)
    train = {k: v for k, v in _series(rows, "loss").items() if not k.startswith("eval")}
    held_out = {k: v for k, v in _series(rows, "ppl").items() if k.startswith("eval")} or {
        k: v for k, v in _series(rows, "loss").items() if k.startswith("eval")
    }
    objective = training_objective(metrics_path)
    panels = [
        ("Training batches, each optimizer step", "nats/token", train, {"loss": objective}),
        (
            _wrapped(["Held-out (recipe's data.eval)", measured_on.training_eval(metrics_path)]),
            "LM perplexity" if any("ppl" in k for k in held_out) else "LM loss (nats/token)",
            held_out,
            {"eval_ppl": "held-out LM perplexity", "eval_loss": "held-out LM loss"},
        ),
    ]
    panels = [p for p in panels if p[2]]
    # One step axis for both panels: a run logged once shows its one train point where it belongs.
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False, sharex=True)
    for ax, (title, ylabel, series, names) in zip(axes[0], panels):
        for key, pts in sorted(series.items()):
            ax.plot(*zip(*pts), marker="." if len(pts) < 50 else None, label=names.get(key, key))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
