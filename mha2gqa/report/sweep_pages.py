"""sweep.md and sweep.html: the settings, the recommendation, the candidates' table and the plots (plots.py).
The table's metric columns are the report's (eval/metrics.py METRICS): every main metric a row has a value for,
with its header, arrow and format, the parent standing for the report's baseline and reference."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from mha2gqa.corpus.probe import parse_domains
from mha2gqa.eval import metrics
from mha2gqa.report.render import CSS, DASH, fmt_bytes
from mha2gqa.report.sweep_plots import (
    domain_names,
    pareto_front,
    quality_plot,
    quality_points,
    sensitivity_plot,
)
from mha2gqa.sweep.folder import QUALITY_PNG, SENSITIVITY_PNG
from mha2gqa.sweep.rows import OWN_COLUMNS, heads_text

_NAMED = (
    ("candidate", lambda r, ctx: r["name"]),
    (
        "kv heads",
        lambda r, ctx: str(r["groups"]) if r["groups"] else heads_text(r).removesuffix(f" (budget {r['budget']})"),
    ),
    ("method", lambda r, ctx: r["method"]),
)
_COSTS = (
    ("convert s", lambda r, ctx: DASH if r.get("convert_wall_s") is None else f"{r['convert_wall_s']:.1f}"),
    (
        "convert peak RSS",
        lambda r, ctx: DASH if r.get("convert_peak_rss_bytes") is None else fmt_bytes(r["convert_peak_rss_bytes"]),
    ),
    ("Pareto", lambda r, ctx: "★" if r["name"] in ctx else ""),
    ("check", lambda r, ctx: r.get("check") or ""),  # convert's verdict, from the sweep's evaluation
)


def _metric_column(metric: metrics.Metric, key: str | None = None, header: str | None = None):
    """A column of the report's `metric`, read from the sweep row's `key` (default: the metric's name); a
    missing value is a dash. The sweep's baseline and reference are always the parent."""
    shown = header or metrics.header(metric, None).replace("baseline", "parent").replace("ref‖", "parent‖")

    def cell(row, ctx):
        value = row.get(key or metric.name)
        return DASH if value is None else metric.fmt(value)

    return (shown, cell)


def metric_columns(rows: list[dict]) -> list:
    """Every main metric with a column (METRICS) that a row has a value for, in the report's order, the KV
    bytes of a whole sequence beside those of a token."""
    found = []
    for metric in metrics.METRICS + metrics.RETRIEVAL:
        if metric.column and metric.name not in OWN_COLUMNS and any(r.get(metric.name) is not None for r in rows):
            found.append(_metric_column(metric))
            if metric.name == "kv_bytes_per_token":
                found.append(_metric_column(metric, "kv_bytes_per_sequence", "KV / sequence"))
    return found


def _domain_cell(name: str):
    def cell(row, ctx):
        d = (row.get("domains") or {}).get(name)
        if d is None:
            return DASH
        if not isinstance(d, dict):  # the parent's row: its perplexity alone
            return metrics.fmt_ppl(d)
        return f"{metrics.fmt_ppl(d['perplexity'])} ({d['ratio']:.2f}×)"

    return cell


def columns(record: dict, rows: list[dict]) -> list:
    """The table's (header, cell) pairs: the candidate, its metric columns and its costs; before the KV columns,
    per domain of --data the perplexity with its ratio to the parent's, and the geometric mean of the ratios."""
    chosen = [*_NAMED, *metric_columns(rows), *_COSTS]
    names = domain_names(record)
    if not names:
        return chosen
    at = next(i for i, (h, _) in enumerate(chosen) if h.startswith("KV / token"))
    ratio = _metric_column(metrics.DOMAINS_RATIO)
    per = [(f"{name} ppl (× parent) ↓", _domain_cell(name)) for name in names]
    return [*chosen[:at], ratio, *per, *chosen[at:]]


def table(record: dict) -> tuple[list[str], list[list[str]]]:
    """Headers and cells: the parent first, then the candidates in the order they ran."""
    front = pareto_front(quality_points(record))
    parent = record["parent"]
    at = f" @ {record['context']}" if record["context"] else ""  # the model's context, in tokens
    first = {"name": "parent", "groups": record["source"]["kv_heads"], "method": "—", "kv_saving": 1.0, **parent}
    rows = [first, *record["candidates"]]
    chosen = columns(record, rows)
    headers = [h + (at if h == "KV / sequence" else "") for h, _ in chosen]
    return headers, [[cell(r, front) for _, cell in chosen] for r in rows]


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
