"""A serve-bench result as a section of `mha2gqa report`: the engine's KV and greedy checks and the throughput per
concurrency as tables (the same rows in Markdown and HTML), and a plot of throughput against concurrency."""

from __future__ import annotations

import html
from pathlib import Path

from mha2gqa.runtime.units import format_bytes

DASH = "—"


def title(found: dict) -> str:
    s, e = found["settings"], found["engine"]
    how = ", eager" if s.get("eager") else ""
    return (
        f"Serving (vLLM {e.get('version') or '?'}, {s['dtype']}{how}, KV budget {format_bytes(s['kv_budget_bytes'])}, "
        f"context {s['context']:,})"
    )


def kv_rows(found: dict) -> tuple[list[str], list[list[str]]]:
    """Per model: kv heads, the engine's KV tokens, the child/parent ratio beside the formula's, the maximum
    concurrency, the greedy checks."""
    s = found["settings"]
    ratios = {row["label"]: row for row in found.get("comparison") or []}
    head = ["model", "kv heads", "KV tokens (engine)", "× parent (formula)", f"max concurrency at {s['context']:,}"]
    head += ["greedy = transformers", f"follows parent (of {s['greedy_tokens']} tokens)"]
    rows = []
    for m in found["models"]:
        engine, g = m["kv"]["engine"], m["greedy"]
        r = ratios.get(m["label"])
        ratio = f"{r['kv_tokens_ratio']:.2f}x ({r['formula_ratio']:.2f}x)" if r and r["kv_tokens_ratio"] else DASH
        rows.append(
            [
                m["label"],
                str(m["kv_heads"]),
                f"{engine['tokens']:,}" if engine.get("tokens") is not None else DASH,
                ratio,
                f"{engine['max_concurrency']:.2f}x" if engine.get("max_concurrency") is not None else DASH,
                f"{g['equal']}/{len(g['prompts'])}",
                f"{g['follows_parent_mean']:.1f}" if r else DASH,
            ]
        )
    return head, rows


def speed_rows(found: dict) -> tuple[list[str], list[list[str]]]:
    """Per model and concurrency: output tokens/s (× the parent's) and time per output token, medians."""
    levels = found["settings"].get("concurrency") or []
    ratios = {row["label"]: row["throughput_ratio"] for row in found.get("comparison") or []}
    rows = []
    for m in found["models"]:
        at = {p["concurrency"]: p for p in m["throughput"]}
        cells = [m["label"]]
        for c in levels:
            p, ratio = at.get(c), (ratios.get(m["label"]) or {}).get(str(c))
            cells.append(
                DASH
                if p is None
                else f"{p['output_tokens_per_s']:,.1f} tok/s"
                + (f" ({ratio:.2f}x)" if ratio else "")
                + (f", {p['tpot_ms']:,.1f} ms" if p.get("tpot_ms") is not None else "")
            )
        rows.append(cells)
    return ["model"] + [f"concurrency {c}" for c in levels], rows


def load_note(found: dict) -> str:
    load, s = found.get("load") or {}, found["settings"]
    before, after = (load.get("before") or [None])[0], (load.get("after") or [None])[0]
    return (
        f"Throughput: output tokens/s over {s['waves']} x concurrency requests of {s['prompt_tokens']} prompt + "
        f"{s['output_tokens']} output tokens (× the parent's), and the time per output token after the first; "
        f"medians of {s['repeats']} runs, the models in turn. Load {_load(before)} before, {_load(after)} after, on "
        f"{load.get('cpu_count', '?')} CPUs."
    )


def _load(value) -> str:
    return "?" if value is None else f"{value:.2f}"


def markdown(found: dict, plot: Path | None, out_dir: Path) -> list[str]:
    lines = ["", f"## {title(found)}", ""]
    for head, rows in (kv_rows(found), speed_rows(found) if found["settings"].get("concurrency") else (None, None)):
        if head is None:
            continue
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    if found["settings"].get("concurrency"):
        lines.append(load_note(found))
    lines += [f"- {w}" for w in found.get("warnings") or []]
    if plot is not None:
        lines += ["", f"![serving throughput]({plot.relative_to(out_dir)})"]
    return lines


def html_section(found: dict, plot_html: str) -> str:
    esc = html.escape

    def table(head, rows):
        top = "".join(f"<th>{esc(h)}</th>" for h in head)
        body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f"<div class='wide'><table><tr>{top}</tr>{body}</table></div>"

    parts = [f"<h2>{esc(title(found))}</h2>", table(*kv_rows(found))]
    if found["settings"].get("concurrency"):
        parts += [table(*speed_rows(found)), f"<p>{esc(load_note(found))}</p>"]
    parts += [f"<ul class='notes'>{''.join(f'<li>{esc(w)}</li>' for w in found.get('warnings') or [])}</ul>"]
    return "".join(parts) + plot_html


def plot(found: dict, out: Path) -> Path | None:
    """Output tokens/s and time per output token against concurrency, one line per model; None without timing."""
    from mha2gqa.report import plots

    measured = [m for m in found["models"] if m["throughput"]]
    if not measured:
        return None
    fig, (speed, latency) = plots.plt.subplots(1, 2, figsize=(12, 4.5))
    levels = sorted({p["concurrency"] for m in measured for p in m["throughput"]})
    for m in measured:
        pts = sorted(m["throughput"], key=lambda p: p["concurrency"])
        label = f"{m['label']} ({m['kv_heads']} kv)"
        speed.plot([p["concurrency"] for p in pts], [p["output_tokens_per_s"] for p in pts], marker="o", label=label)
        tpot = [(p["concurrency"], p["tpot_ms"]) for p in pts if p.get("tpot_ms") is not None]
        latency.plot([c for c, _ in tpot], [t for _, t in tpot], marker="o", label=label)
    for ax, what in ((speed, "output tokens/s (median)"), (latency, "time per output token, ms (median)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent requests (log scale)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    speed.set_title(title(found), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=plots.DPI)
    plots.plt.close(fig)
    return out


def sections(served: list[dict], out_dir: Path) -> tuple[str, str, dict[str, Path]]:
    """(markdown, html, {name: png}) of every serve-bench result given to the report, one section each."""
    md, page, drawn = [], [], {}
    for i, found in enumerate(served):
        name = "serving_throughput" if i == 0 else f"serving_throughput_{i + 1}"
        png = plot(found, out_dir / f"{name}.png")
        if png is not None:
            drawn[name] = png
        md += markdown(found, png, out_dir)
        figure = "" if png is None else f"<figure><img alt='{name}' src='data:image/png;base64,{_b64(png)}'></figure>"
        page.append(html_section(found, figure))
    return "\n".join(md) + ("\n" if md else ""), "".join(page), drawn


def _b64(path: Path) -> str:
    import base64

    return base64.b64encode(path.read_bytes()).decode()
