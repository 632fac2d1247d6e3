"""The comparison table as Markdown and as a self-contained HTML page (plots inlined as base64)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from mha2gqa.units import format_bytes

DASH = "—"


def _num(x, fmt):
    return DASH if x is None else fmt(x)


def fmt_bytes(n: float) -> str:
    return format_bytes(n, digits=1, largest="MiB")


def _fmt_ppl(x):
    return f"{x:,.0f}" if x >= 1000 else f"{x:.2f}"


def columns(speed_point, lm_eval: list[dict] | None = None) -> list[tuple[str, str, callable]]:
    """(header, row key, formatter) of every table column."""
    at = f" @ B={speed_point[0]}, T={speed_point[1]}" if speed_point else ""
    return [
        ("model", "label", str),
        ("role", "role", str),
        ("kv heads", "kv_heads", lambda r: f"{r['kv_heads']}/{r['heads']}"),
        ("perplexity", "perplexity", _fmt_ppl),
        ("Δ ppl vs baseline", "perplexity_change", lambda x: f"{100 * x:+.1f}%"),
        ("recovery", "recovery", lambda x: f"{100 * x:.0f}%"),
        ("KL(ref‖model)", "kl_mean", lambda x: f"{x:.4f}"),
        ("top-1 agree", "top1_agreement", lambda x: f"{100 * x:.1f}%"),
        ("KV / token", "kv_bytes_per_token", fmt_bytes),
        ("KV saving", "kv_saving", lambda x: f"{x:.2f}×"),
        (f"decode tok/s{at}", "tokens_per_s", lambda x: f"{x:,.0f}" if x >= 100 else f"{x:.1f}"),
        ("speed-up", "speedup", lambda x: f"{x:.2f}×"),
    ] + lm_eval_columns(lm_eval or [])


def lm_eval_columns(found: list[dict]) -> list[tuple[str, str, callable]]:
    """Per lm-eval task metric: its value ± standard error, and Δ vs the baseline (percent for
    perplexities, percentage points for accuracies, plain difference otherwise)."""
    cols = []
    for c in found:
        scale = "relative" if c["relative"] else "percent" if c["percent"] else "plain"
        delta = {
            "relative": lambda x: f"{100 * x:+.1f}%",
            "percent": lambda x: f"{100 * x:+.1f} pt",
            "plain": lambda x: f"{x:+.4g}",
        }[scale]
        cols.append((f"{c['task']} {c['metric']}", f"lm_eval:{c['key']}", _fmt_with_stderr(scale)))
        cols.append((f"Δ {c['metric']}", f"lm_eval_delta:{c['key']}", delta))
    return cols


def _fmt_with_stderr(scale: str):
    one = {"relative": _fmt_ppl, "percent": lambda x: f"{100 * x:.1f}", "plain": lambda x: f"{x:.4g}"}[scale]

    def fmt(cell):
        text = one(cell["value"]) + ("%" if scale == "percent" else "")
        return text if cell.get("stderr") is None else f"{text} ± {one(cell['stderr'])}"

    return fmt


def cells(row: dict, cols) -> list[str]:
    out = []
    for _, key, fmt in cols:
        out.append(fmt(row) if key == "kv_heads" else _num(row[key], fmt))
    if row["kv_match"] is False:
        out[8] += " ⚠"  # the live cache disagrees with the formula: see the notes
    return out


def markdown(rows, meta, results, plots: dict[str, Path], out_dir: Path) -> str:
    cols = columns(meta["speed_point"], meta.get("lm_eval"))
    lines = [
        "# mha2gqa comparison report",
        "",
        f"Baseline: **{meta['baseline']}** (Δ, saving and speed-up are relative to it).",
        "",
        "| " + " | ".join(h for h, _, _ in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(cells(r, cols)) + " |" for r in rows]
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
td:first-child,td:nth-child(2),th:first-child,th:nth-child(2){text-align:left}
tr.baseline td{font-weight:600;background:#fbfbe8}
.notes li{color:#8a4b00} img{max-width:100%;border:1px solid #eee;margin:0.5rem 0}
.prov td,.prov th{text-align:left;font-size:12px;white-space:normal}
"""


def html_page(rows, meta, results, plots: dict[str, Path]) -> str:
    cols = columns(meta["speed_point"], meta.get("lm_eval"))
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h, _, _ in cols)
    body = "".join(
        ("<tr class='baseline'>" if r["label"] == meta["baseline"] else "<tr>")
        + "".join(f"<td>{esc(c)}</td>" for c in cells(r, cols))
        + "</tr>"
        for r in rows
    )
    notes = "".join(f"<li>{esc(n)}</li>" for n in meta["notes"])
    imgs = "".join(
        f'<figure><img alt="{esc(name)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}"></figure>'
        for name, p in plots.items()
    )
    prov = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in provenance_cells(r)) + "</tr>" for r in results)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>mha2gqa report</title><style>{CSS}</style></head><body>"
        f"<h1>mha2gqa comparison report</h1><p>Baseline: <b>{esc(meta['baseline'])}</b> "
        "(Δ, saving and speed-up are relative to it).</p>"
        f"<table><tr>{head}</tr>{body}</table>"
        + (f"<h2>Notes</h2><ul class='notes'>{notes}</ul>" if notes else "")
        + f"<h2>Plots</h2>{imgs}<h2>Provenance</h2><table class='prov'><tr><th>model</th><th>path</th><th>params</th>"
        f"<th>dtype</th><th>data</th><th>device</th></tr>{prov}</table></body></html>\n"
    )
