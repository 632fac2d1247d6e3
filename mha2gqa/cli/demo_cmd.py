"""`mha2gqa demo` and `mha2gqa reproduce`: the embedded default, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mha2gqa.cli.format import human_bytes, table


def _summary(report_json: Path) -> str:
    """A short table from the report's rows: what was lost and what was saved."""
    rows = json.loads(report_json.read_text())["rows"]
    lines = []
    for row in rows:
        def fmt(key, spec):
            value = row.get(key)
            return format(value, spec) if isinstance(value, (int, float)) else "-"
        lines.append([row.get("label", "?"), fmt("perplexity", ".2f"), fmt("kl_mean", ".4f"), fmt("top1_agreement", ".3f"),
                      human_bytes(row["kv_bytes_per_token"]) if row.get("kv_bytes_per_token") else "-",
                      fmt("recovery", ".2f")])
    return table(["model", "perplexity", "KL vs parent", "top-1 agree", "KV/token", "recovery"], lines)


@click.command()
@click.option("--groups", default=2, show_default=True, help="Target kv heads for the embedded 8-head model (1, 2 or 4).")
@click.option("--out", default="./mha2gqa-demo", show_default=True, type=click.Path(path_type=Path),
              help="Where the converted and uptrained models, results and report go.")
@click.option("--quick", is_flag=True, help="About 2 minutes: a slice of the held-out novel, alpha=1%, no speed grid.")
@click.option("--alpha", type=float, default=None,
              help="Uptraining budget as a fraction of the parent's pretraining tokens [default: 0.05; 0.01 with --quick].")
def demo(groups, out, quick, alpha):
    """Run the whole job on the embedded default (a small Llama MHA model trained on five Jane Austen
    novels; no download): inspect, convert to GROUPS kv heads by mean-pooling, evaluate the parent and
    the converted model on held-out Persuasion, uptrain for ALPHA of the parent's pretraining tokens,
    evaluate again, and write a side-by-side report (markdown, html, plots) under OUT."""
    from mha2gqa.demo import run_demo

    written = run_demo(out, groups=groups, quick=quick, alpha=alpha, echo=click.echo)
    click.echo(_summary(Path(written["json"])))
    click.echo(f"report: {written['html']}")


@click.command()
@click.option("--out", default="docs/ablations", show_default=True, type=click.Path(path_type=Path),
              help="Where ablations.json, ablations.md and the plots go.")
@click.option("--methods", default="mean,first,random", show_default=True, help="Conversion methods, comma-separated.")
@click.option("--kv-heads", default="1,2,4", show_default=True, help="Target kv-head counts, comma-separated.")
@click.option("--alphas", default="0,0.025,0.05,0.1", show_default=True,
              help="Uptraining budgets (fractions of the parent's pretraining tokens), comma-separated.")
@click.option("--eval-blocks", default=32, show_default=True, help="Held-out 512-token blocks of Persuasion per evaluation.")
def reproduce(out, methods, kv_heads, alphas, eval_blocks):
    """Reproduce the GQA paper's ablations at small scale on the embedded default: perplexity on
    held-out Persuasion for every method x kv heads x alpha, as a table and plots under OUT."""
    from mha2gqa.errors import InputError
    from mha2gqa.reproduce import run_grid
    from mha2gqa.reproduce_report import markdown_table, plot

    def parse(text, kind, flag):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise InputError(f"{flag} {text!r} must be a comma-separated list of numbers, e.g. 0,0.05") from None

    grid = run_grid(out, methods=tuple(m.strip() for m in methods.split(",")), kv_heads=parse(kv_heads, int, "--kv-heads"),
                    alphas=parse(alphas, float, "--alphas"), eval_blocks=eval_blocks, echo=click.echo)
    (out / "ablations.md").write_text(markdown_table(grid))
    config = json.loads((Path(grid["parent"]) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    plots = plot(grid, out, kv_bytes_per_head=2 * config["num_hidden_layers"] * head_dim * 4)
    click.echo(markdown_table(grid))
    click.echo(f"wrote {out / 'ablations.json'}, {out / 'ablations.md'}, " + ", ".join(map(str, plots)))
