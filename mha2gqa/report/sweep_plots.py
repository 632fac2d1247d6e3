"""The sweep's plots: perplexity against KV bytes per token with its Pareto front (and, over several domains,
each domain's ratio to the parent), and after --refine the per-layer sensitivity heat map. Built with the
report's plotting helpers (report/plots.py)."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.ticker import FuncFormatter, NullFormatter

from mha2gqa.report import measured_on, plots
from mha2gqa.report.plots import plt
from mha2gqa.runtime.units import byte_unit
from mha2gqa.sweep.options import BROKEN_SLACK
from mha2gqa.sweep.rows import methods_of


def pareto_front(points: list[tuple[float, float, str]]) -> list[str]:
    """Names of the (x, y, name) points no other point beats on both axes (smaller is better on each)."""
    return [
        name for x, y, name in points if not any(x2 <= x and y2 <= y and (x2, y2) != (x, y) for x2, y2, _ in points)
    ]


def quality_points(record: dict) -> list[tuple[float, float, str]]:
    parent = record["parent"]
    found = [(parent["kv_bytes_per_token"], parent["perplexity"], "parent")]
    return found + [(r["kv_bytes_per_token"], r["perplexity"], r["name"]) for r in record["candidates"]]


# Tick mantissas of a log axis, finest first: the first that labels the range in few ticks is used.
_LOG_MANTISSAS = (
    tuple(round(1 + i / 10, 1) for i in range(90)),  # 1.0, 1.1, ... 9.9: a narrow range
    (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9),
    (1, 1.5, 2, 3, 5, 7),
    (1, 2, 5),
    (1, 3),
    (1,),
)


def log_ticks(low: float, high: float, most: int = 8) -> list[float]:
    """Round tick values for a log axis from one at or below `low` to one at or above `high`, at most `most`
    of them where a tick per decade allows: matplotlib's decades left the parent's 244.9 below the lowest
    labelled tick (300) of a sweep's plot, so it could not be read off."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    for mantissas in _LOG_MANTISSAS:
        ticks = [float(f"{m * 10.0**e:.6g}") for e in range(first, last + 1) for m in mantissas]
        below = max(t for t in ticks if t <= low * (1 + 1e-9))
        above = min(t for t in ticks if t >= high * (1 - 1e-9))
        chosen = [t for t in ticks if below <= t <= above]
        if len(chosen) <= most:
            return chosen
    step = math.ceil((last - first) / (most - 1))  # many decades: every step-th one
    return [10.0**e for e in range(first, last + step, step)]


def quality_plot(record: dict, out: Path) -> Path:
    """Perplexity (log) against KV bytes per token: one line per method, the parent as a star, the Pareto
    front ringed and joined."""
    points = quality_points(record)
    div, unit = byte_unit(max(x for x, _, _ in points), largest="MiB")
    names = domain_names(record)
    fig, axes = plt.subplots(1, 2 if names else 1, figsize=(14 if names else 7.5, 4.8), squeeze=False)
    ax = axes[0][0]
    if names:
        _domains_panel(axes[0][1], record, names, div, unit)
    for method in methods_of(record):
        rows = sorted((r for r in record["candidates"] if r["method"] == method), key=lambda r: r["kv_bytes_per_token"])
        if rows:
            ax.plot(
                [r["kv_bytes_per_token"] / div for r in rows], [r["perplexity"] for r in rows], marker="o", label=method
            )
            for r in rows:
                ax.annotate(
                    f"{r['groups']} kv" if r["groups"] else f"budget {r['budget']}",
                    (r["kv_bytes_per_token"] / div, r["perplexity"]),
                    xytext=(6, 4),
                    textcoords="offset points",
                    fontsize=8,
                )
    parent = record["parent"]
    ax.scatter(
        parent["kv_bytes_per_token"] / div,
        parent["perplexity"],
        marker="*",
        s=220,
        color="black",
        zorder=4,
        label=f"parent ({record['source']['kv_heads']} kv)",
    )
    front = sorted((x, y) for x, y, name in points if name in pareto_front(points))
    xs, ys = [x / div for x, _ in front], [y for _, y in front]
    ax.step(xs, ys, where="post", linestyle="--", color="gray", zorder=1)  # the boundary of what is reachable
    ax.scatter(xs, ys, s=240, facecolors="none", edgecolors="gray", zorder=2, label="Pareto front")
    ax.set_yscale("log")
    ticks = log_ticks(min(y for _, y, _ in points), max(y for _, y, _ in points))
    ax.set_yticks(ticks)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.4g}"))  # not 1.306 x 10^2
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(ticks[0] / 1.04, ticks[-1] * 1.04)  # a labelled tick below and above every point
    ax.set_xlabel(f"KV cache per token ({unit})")
    pooled = ", all domains' tokens pooled" if names else ""
    ax.set_ylabel(f"perplexity (log scale{pooled}, lower is better)")
    scored = measured_on.perplexity([parent["result"]]) if parent.get("result") else ""  # every candidate's text too
    ax.set_title(
        "Sweep: quality vs KV-cache size, before any training" + (f"\n{scored}" if scored else ""), fontsize=10
    )
    ax.margins(x=0.15, y=0.15)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=9)
    return plots._save(fig, out)


def _domains_panel(ax, record: dict, names: list[str], div: float, unit: str) -> None:
    """Each domain's perplexity ratio to the parent against KV bytes per token: a colour per domain, a line
    style per method, and the line above which recommend calls a candidate broken."""
    styles = ("-", "--", ":", "-.")
    for m, method in enumerate(methods_of(record)):
        rows = sorted((r for r in record["candidates"] if r["method"] == method), key=lambda r: r["kv_bytes_per_token"])
        for d, name in enumerate(names):
            found = [
                (r["kv_bytes_per_token"] / div, r["domains"][name]["ratio"])
                for r in rows
                if name in (r.get("domains") or {})
            ]
            if found:
                ax.plot(
                    *zip(*found),
                    marker="o",
                    linestyle=styles[m % len(styles)],
                    color=f"C{d}",
                    label=f"{name} ({method})",
                )
    cap = 1 + BROKEN_SLACK * record["settings"]["tolerance"]
    ax.axhline(cap, color="red", linewidth=1, label=f"broken above {cap:.2f}×")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.scatter(
        record["parent"]["kv_bytes_per_token"] / div, 1.0, marker="*", s=220, color="black", zorder=4, label="parent"
    )
    ax.set_yscale("log")
    times = FuncFormatter(lambda value, _: f"{value:.3g}×")
    ax.yaxis.set_major_formatter(times)
    ax.yaxis.set_minor_formatter(times)
    ax.set_xlabel(f"KV cache per token ({unit})")
    ax.set_ylabel("perplexity / the parent's, per domain (log)")
    ax.set_title("Per domain of --data")
    ax.margins(x=0.15, y=0.15)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def sensitivity_plot(record: dict, out: Path) -> Path | None:
    """Layers x kv heads, per method: each layer's relative attention-output error after --refine on its
    held-out calibration tokens (None without --refine)."""
    refined = [r for r in record["candidates"] if r.get("refine")]
    methods = [m for m in record["settings"]["methods"] if any(r["method"] == m for r in refined)]
    if not methods:
        return None
    counts = sorted({r["groups"] for r in refined}, reverse=True)
    layers = max(len(r["refine"]["layers"]) for r in refined)
    grids = {m: [[float("nan")] * len(counts) for _ in range(layers)] for m in methods}
    for r in refined:
        for row in r["refine"]["layers"]:
            grids[r["method"]][row["layer"]][counts.index(r["groups"])] = row["heldout_error_after"]
    top = max(v for grid in grids.values() for line in grid for v in line if v == v) or 1.0
    fig, axes = plt.subplots(
        1,
        len(methods),
        figsize=(1.2 + 2.2 * len(methods) + 0.6 * len(counts) * len(methods), 1.6 + 0.42 * layers),
        squeeze=False,
    )
    for ax, method in zip(axes[0], methods):
        image = ax.imshow(grids[method], cmap="magma_r", vmin=0, vmax=top, aspect="auto")
        for i, line in enumerate(grids[method]):
            for j, value in enumerate(line):
                if value == value:
                    ax.text(
                        j,
                        i,
                        f"{value:.3f}",
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white" if value > 0.6 * top else "black",
                    )
        ax.set_xticks(range(len(counts)), [str(c) for c in counts])
        ax.set_yticks(range(layers), [str(i) for i in range(layers)])
        ax.set_xlabel("kv heads")
        ax.set_ylabel("layer")
        ax.set_title(method)
    fig.colorbar(image, ax=list(axes[0]), shrink=0.9, label="relative output error")
    fig.suptitle("Per-layer attention-output error after --refine (held-out calibration tokens)", fontsize=10)
    fig.savefig(out, dpi=plots.DPI, bbox_inches="tight")
    plt.close(fig)
    return out


def domain_names(record: dict) -> list[str]:
    """The --data domains of a sweep measured on two or more, else [] (one text: the perplexity column)."""
    names = list((record.get("parent") or {}).get("domains") or {})
    return names if len(names) > 1 else []
