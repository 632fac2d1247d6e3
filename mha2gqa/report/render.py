"""The comparison table as Markdown and as a self-contained HTML page (plots inlined as base64)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from mha2gqa.eval import metrics
from mha2gqa.eval.metrics import DASH, fmt_bytes  # noqa: F401  (the sweep's page formats with them too)


def tables(rows: list[dict], results: list[dict]) -> list[tuple[str | None, list[metrics.Metric]]]:
    """(title, columns) of each table: the main one, then per domain and lm-eval's (beside the model's label), each
    without the columns no result has a value for (the notes name them)."""
    shown = [m for m in metrics.entries(results) if metrics.shown(m, rows)]
    label = metrics.BY_NAME["label"]
    lm_eval = [m for m in shown if m.group == "lm_eval"]
    per_domain = [m for m in shown if m.group == "domains"]
    retrieval = [m for m in shown if m.group == "retrieval"]
    main = [m for m in shown if m.group == "main"]
    return (
        [(None, main)]
        + ([("Quality per domain", [label, *per_domain])] if per_domain else [])
        + ([("Retrieval recall per context length", [label, *retrieval])] if retrieval else [])
        + ([("lm-evaluation-harness tasks", [label, *lm_eval])] if lm_eval else [])
    )


def _markdown_table(rows, cols, speed_point) -> list[str]:
    lines = ["| " + " | ".join(metrics.header(c, speed_point) for c in cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(c.text(r) for c in cols) + " |" for r in rows]


HEADING = "# mha2gqa comparison report\n"


def empty_page() -> str:
    """The HTML page of a report without eval results (serve-bench results alone): its heading only."""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>mha2gqa report</title><style>{CSS}</style></head>"
        "<body><h1>mha2gqa comparison report</h1></body></html>\n"
    )


def markdown(rows, meta, results, plots: dict[str, Path], out_dir: Path) -> str:
    lines = [HEADING.strip(), "", baseline_line(meta, results).replace("<b>", "**").replace("</b>", "**")]
    for title, cols in tables(rows, results):
        lines += [""] + ([f"## {title}", ""] if title else []) + _markdown_table(rows, cols, meta["speed_point"])
    if meta["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    lines += ["", "## Plots", ""] + [f"![{name}]({p.relative_to(out_dir)})" for name, p in plots.items()]
    lines += [
        "",
        "## Provenance",
        "",
        "| model | path | params | dtype | data (ids sha256) | device |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(provenance_cells(r)) + " |" for r in results]
    return "\n".join(lines) + "\n"


def baseline_line(meta: dict, results: list[dict], esc=lambda text: text) -> str:
    """What the table's ratios are relative to (<b> marks the name): the baseline, where it came from when it is
    a result's own reference, or that there is nothing to compare with."""
    if meta["baseline"] is None:
        return "Nothing to compare with: one result, without a reference (see the notes)."
    base = next(r for r in results if r["label"] == meta["baseline"])
    source = (
        f", from {esc(base['from_result_of'])}'s result file (its numbers on the same windows; KV bytes by formula)"
        if base.get("from_result_of")
        else ""
    )
    return (
        f"Baseline: <b>{esc(meta['baseline'])}</b>{source} (Δ, saving and speed-up are relative to it; ↓ lower, "
        "↑ higher is better)."
    )


def provenance_cells(r: dict) -> list[str]:
    data = r.get("data") or {}
    digest = (data.get("ids_sha256") or "")[:12]
    tokens = f"{data.get('tokens', 0):,} tokens, {digest}" if data else DASH
    env = r["env"]
    return [
        r["label"],
        r["model"].get("path", DASH),
        f"{r['model'].get('params', 0):,}",
        str(r["model"].get("dtype")),
        tokens,
        f"{env.get('device_name')} ({env.get('device')})",
    ]


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1300px;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:1rem 0;font-size:14px}
th,td{border:1px solid #ccc;padding:6px 10px;text-align:right;white-space:nowrap}
th{background:#f3f3f3;white-space:normal;max-width:8em;vertical-align:bottom}
td.t,th.t{text-align:left} .wide{overflow-x:auto}
tr.baseline td{font-weight:600;background:#fbfbe8}
.notes li{color:#8a4b00} img{max-width:100%;border:1px solid #eee;margin:0.5rem 0}
.prov td,.prov th{text-align:left;font-size:12px;white-space:normal}
"""


def html_page(rows, meta, results, plots: dict[str, Path]) -> str:
    esc = html.escape

    def table(title, cols):
        text = {c.name: " class='t'" if c.name in ("label", "role") else "" for c in cols}  # left-aligned
        # Long task names (persuasion_next_sentence) may break after an underscore, not across the next cell.
        head = "".join(
            f"<th{text[c.name]}>{esc(metrics.header(c, meta['speed_point'])).replace('_', '_<wbr>')}</th>" for c in cols
        )
        body = "".join(
            ("<tr class='baseline'>" if r["label"] == meta["baseline"] else "<tr>")
            + "".join(f"<td{text[c.name]}>{esc(c.text(r))}</td>" for c in cols)
            + "</tr>"
            for r in rows
        )
        return (
            f"<h2>{esc(title)}</h2>" if title else ""
        ) + f"<div class='wide'><table><tr>{head}</tr>{body}</table></div>"

    notes = "".join(f"<li>{esc(n)}</li>" for n in meta["notes"])
    imgs = "".join(
        f'<figure><img alt="{esc(name)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}"></figure>'
        for name, p in plots.items()
    )
    prov = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in provenance_cells(r)) + "</tr>" for r in results)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>mha2gqa report</title><style>{CSS}</style></head><body>"
        f"<h1>mha2gqa comparison report</h1><p>{baseline_line(meta, results, esc)}</p>"
        + "".join(table(title, cols) for title, cols in tables(rows, results))
        + (f"<h2>Notes</h2><ul class='notes'>{notes}</ul>" if notes else "")
        + f"<h2>Plots</h2>{imgs}<h2>Provenance</h2><table class='prov'><tr><th>model</th><th>path</th><th>params</th>"
        f"<th>dtype</th><th>data</th><th>device</th></tr>{prov}</table></body></html>\n"
    )
