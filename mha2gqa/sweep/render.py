"""sweep.md and sweep.html: the candidates' table, the quality-vs-KV plot with its Pareto front and, after
--refine, the per-layer sensitivity heat map. Built with the report's plotting and formatting helpers."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

from matplotlib.ticker import FuncFormatter, NullFormatter

from mha2gqa.corpus.probe import parse_domains
from mha2gqa.eval import measured_on, metrics, plots
from mha2gqa.eval.plots import plt
from mha2gqa.eval.render import CSS, DASH, fmt_bytes
from mha2gqa.sweep.options import BROKEN_SLACK
from mha2gqa.units import byte_unit

QUALITY_PNG = "sweep_quality_vs_kv.png"
SENSITIVITY_PNG = "sweep_layer_sensitivity.png"


def pareto_front(points: list[tuple[float, float, str]]) -> list[str]:
    """Names of the (x, y, name) points no other point beats on both axes (smaller is better on each)."""
    return [
        name for x, y, name in points if not any(x2 <= x and y2 <= y and (x2, y2) != (x, y) for x2, y2, _ in points)
    ]


def _points(record: dict) -> list[tuple[float, float, str]]:
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
    points = _points(record)
    div, unit = byte_unit(max(x for x, _, _ in points), largest="MiB")
    names = domain_names(record)
    fig, axes = plt.subplots(1, 2 if names else 1, figsize=(14 if names else 7.5, 4.8), squeeze=False)
    ax = axes[0][0]
    if names:
        _domains_panel(axes[0][1], record, names, div, unit)
    for method in record["settings"]["methods"]:
        rows = sorted((r for r in record["candidates"] if r["method"] == method), key=lambda r: r["kv_bytes_per_token"])
        if rows:
            ax.plot(
                [r["kv_bytes_per_token"] / div for r in rows], [r["perplexity"] for r in rows], marker="o", label=method
            )
            for r in rows:
                ax.annotate(
                    f"{r['groups']} kv",
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
    for m, method in enumerate(record["settings"]["methods"]):
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


def _metric(name: str, key: str | None = None, header: str | None = None):
    """A column of the report's metric `name` (eval/metrics.py: its header, arrow and format), read from the
    sweep row's `key` (default: the same name); a missing value is a dash."""
    metric = metrics.BY_NAME[name]

    def cell(row, ctx):
        value = row.get(key or name)
        return DASH if value is None else metric.fmt(value)

    return (header or metrics.header(metric, None), cell)


COLUMNS = (
    ("candidate", lambda r, ctx: r["name"]),
    ("kv heads", lambda r, ctx: str(r["groups"])),
    ("method", lambda r, ctx: r["method"]),
    _metric("perplexity"),
    _metric("perplexity_change", header="Δ vs parent ↓"),
    _metric("kl_mean", header="KL(parent‖model) ↓"),  # the sweep's reference is always the parent
    _metric("top1_agreement"),
    _metric("kv_bytes_per_token"),
    _metric("kv_bytes_per_token", "kv_bytes_per_sequence", "KV / sequence"),
    _metric("kv_saving"),
    ("convert s", lambda r, ctx: DASH if r.get("convert_wall_s") is None else f"{r['convert_wall_s']:.1f}"),
    (
        "convert peak RSS",
        lambda r, ctx: DASH if r.get("convert_peak_rss_bytes") is None else fmt_bytes(r["convert_peak_rss_bytes"]),
    ),
    ("Pareto", lambda r, ctx: "★" if r["name"] in ctx else ""),
)


def domain_names(record: dict) -> list[str]:
    """The --data domains of a sweep measured on two or more, else [] (one text: the perplexity column)."""
    names = list((record.get("parent") or {}).get("domains") or {})
    return names if len(names) > 1 else []


def _domain_cell(name: str):
    def cell(row, ctx):
        d = (row.get("domains") or {}).get(name)
        if d is None:
            return DASH
        if not isinstance(d, dict):  # the parent's row: its perplexity alone
            return metrics.fmt_ppl(d)
        return f"{metrics.fmt_ppl(d['perplexity'])} ({d['ratio']:.2f}×)"

    return cell


def columns(record: dict) -> list:
    """The table's (header, cell) pairs: COLUMNS, and after the agreement columns, per domain of --data the
    perplexity with its ratio to the parent's, and the geometric mean of the ratios."""
    names = domain_names(record)
    if not names:
        return list(COLUMNS)
    at = next(i for i, (h, _) in enumerate(COLUMNS) if h.startswith("KV / token"))
    ratio = (
        "ppl ratio, geo-mean of domains ↓",
        lambda r, ctx: DASH if r.get("domains_ratio") is None else f"{r['domains_ratio']:.2f}×",
    )
    per = [(f"{name} ppl (× parent) ↓", _domain_cell(name)) for name in names]
    return [*COLUMNS[:at], ratio, *per, *COLUMNS[at:]]


def table(record: dict) -> tuple[list[str], list[list[str]]]:
    """Headers and cells: the parent first, then the candidates in the order they ran."""
    front = pareto_front(_points(record))
    parent = record["parent"]
    at = f" @ {record['context']}" if record["context"] else ""  # the model's context, in tokens
    chosen = columns(record)
    headers = [h + (at if h == "KV / sequence" else "") for h, _ in chosen]
    first = {"name": "parent", "groups": record["source"]["kv_heads"], "method": "—", "kv_saving": 1.0, **parent}
    return headers, [[cell(r, front) for _, cell in chosen] for r in [first, *record["candidates"]]]


def _status(record: dict) -> str:
    done, planned = len(record["candidates"]), len(record["planned"])
    if record["interrupted"]:
        return f"Interrupted: {done} of {planned} candidates finished (the rest did not run)."
    return f"{done} candidate{'' if done == 1 else 's'} in {record['wall_s']:.0f} s."


def _settings_line(record: dict) -> str:
    s = record["settings"]
    calibration = record.get("calibration") or {}
    return (
        f"Source `{record['source']['path']}` ({record['source']['model_type']}, {record['source']['kv_heads']} kv "
        f"heads); methods {', '.join(s['methods'])}; calibration {calibration.get('tokens', s['calibration_tokens']):,} "
        f"tokens (gathered once); eval data {_data_text(s['data'])}"
        + (f", at most {s['max_tokens']:,} tokens" if s["max_tokens"] else "")
        + ("; refined (--refine)" if s["refine"] else "")
        + f"; tolerance {100 * s['tolerance']:g}%."
    )


def _data_text(data) -> str:
    """--data as typed: every text, named."""
    found = parse_domains(data) or {}
    return ", ".join(f"`{name}={path}`" if len(found) > 1 else f"`{path}`" for name, path in found.items())


def write_pages(record: dict, out: Path) -> dict[str, Path]:
    """sweep.md, sweep.html and the PNGs beside them; returns what was written."""
    drawn = {}
    if record["parent"] is not None and record["candidates"]:
        drawn["quality_vs_kv"] = quality_plot(record, out / QUALITY_PNG)
        heat = sensitivity_plot(record, out / SENSITIVITY_PNG)
        if heat:
            drawn["layer_sensitivity"] = heat
    headers, rows = table(record) if record["parent"] is not None else ([], [])
    found = record.get("recommendation") or {}
    line, next_command = found.get("summary", ""), found.get("next")
    md = ["# mha2gqa sweep", "", _settings_line(record), "", _status(record), "", f"**{line}**", ""]
    md += ["```bash", next_command, "```", ""] if next_command else []
    if rows:
        md += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        md += ["| " + " | ".join(r) + " |" for r in rows]
    md += [""] + [f"![{name}]({path.name})" for name, path in drawn.items()]
    esc = html.escape
    text = {0, 2}  # candidate and method: left-aligned (the report's CSS class t)

    def cell(tag: str, i: int, value: str) -> str:
        return f"<{tag}{' class=t' if i in text else ''}>{esc(value)}</{tag}>"

    body = "".join("<tr>" + "".join(cell("td", i, c) for i, c in enumerate(r)) + "</tr>" for r in rows)
    images = "".join(
        f'<figure><img alt="{esc(n)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}"></figure>'
        for n, p in drawn.items()
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>mha2gqa sweep</title><style>{CSS}</style></head>"
        f"<body><h1>mha2gqa sweep</h1><p>{esc(_settings_line(record))}</p><p>{esc(_status(record))}</p>"
        f"<p><b>{esc(line)}</b></p>"
        + (
            f"<pre style='white-space:pre-wrap;word-break:break-all'><code>{esc(next_command)}</code></pre>"
            if next_command
            else ""
        )
        + f"<table><tr>{''.join(cell('th', i, h) for i, h in enumerate(headers))}</tr>{body}</table>"
        f"{images}</body></html>\n"
    )
    written = {"markdown": out / "sweep.md", "html": out / "sweep.html"}
    written["markdown"].write_text("\n".join(md) + "\n")
    written["html"].write_text(page)
    return {**written, **drawn}
