"""`mha2gqa serve-bench`: a parent and its conversions served by vLLM, checked and timed side by side."""

from __future__ import annotations

import click

from mha2gqa.cli.early import validate_out
from mha2gqa.cli.fields import field_option
from mha2gqa.serving.options import DTYPES, ServeOptions


def _option(flag: str, *decls: str, **kwargs):
    return field_option(ServeOptions, flag, *decls, **kwargs)


def _concurrency(ctx, param, value):
    """'1,8,32' -> (1, 8, 32); 'none' -> None (no timing)."""
    if value is None or value.strip().lower() == "none":
        return None
    try:
        found = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers (e.g. 1,8,32) or none") from None
    if not found:
        raise click.BadParameter(f"{value!r} names no concurrency: give e.g. 1,8,32, or none")
    return found


def _renamed_kv_budget(ctx, param, value):
    """The flag this size had before it took vLLM's name: --kv-budget is convert's and sweep's per-token fraction."""
    if value is not None:
        raise click.UsageError(
            "serve-bench --kv-budget is now --kv-cache-memory (each server's whole KV-cache memory, vLLM's "
            f"--kv-cache-memory-bytes): give --kv-cache-memory {value}",
            ctx,
        )


@click.command("serve-bench", short_help="Serve PARENT and its conversions in vLLM: greedy text, KV tokens, speed.")
@click.argument("parent")
@click.argument("children", nargs=-1, required=True)
@_option("--vllm-python")
@_option("--dtype", type=click.Choice(DTYPES))
@_option("--context", type=int)
@_option("--kv-cache-memory")
@click.option("--kv-budget", hidden=True, expose_value=False, is_eager=True, callback=_renamed_kv_budget)
@_option("--greedy-tokens", type=int)
@_option("--prompts-per-domain", type=int)
@_option("--concurrency", callback=_concurrency)
@_option("--prompt-tokens", type=int)
@_option("--output-tokens", type=int)
@_option("--decode-concurrency", type=int)
@_option("--capacity-concurrency")
@_option("--settle-timeout", type=float)
@_option("--waves", type=int)
@_option("--repeats", type=int)
@_option("--eager", is_flag=True)
@_option("--startup-timeout", type=float)
@_option("--logs", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), help="Write the result JSON here (mha2gqa report shows it).")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
def serve_bench(parent, children, out, force, **options):
    """Serve PARENT and each CHILD (its conversions) with vLLM's OpenAI-compatible server, one process group
    each, and measure what the engine sees: whether its greedy text equals transformers' on prompts from every
    probe domain, how long a child's greedy text follows the parent's, the KV-cache tokens and maximum
    concurrency the engine reports for one --kv-cache-memory beside our formula's; then, once the servers are quiet,
    the decode-only time per output token at --decode-concurrency (every model alike), the output tokens/s at a
    concurrency above what the parent's KV cache fits (--capacity-concurrency), and output tokens/s and time per
    output token at each --concurrency, the models in turn. Every server is stopped on every way out.

    Example: mha2gqa serve-bench ./llama ./llama-gqa8 --vllm-python ~/vllm-venv/bin/python --out serve.json
    """
    from mha2gqa.runtime.errors import import_torch

    opts = ServeOptions(**options)
    validate_out(out, force)
    from mha2gqa.serving.bench import prepare

    plan = prepare(parent, list(children), out, opts)  # every refusal before torch's start-up and any server
    import_torch()
    from mha2gqa.runtime import threads

    threads.apply(threads.for_model(parent))  # transformers' reference decode: one thread on a busy machine
    from mha2gqa.serving.bench import serve_bench as run

    found = run(parent, list(children), out, opts, say=lambda line: click.echo(line, err=True), plan=plan)
    click.echo(summary(found))
    for warning in found["warnings"]:
        click.secho(f"WARNING: {warning}", fg="red", bold=True, err=True)
    if out:
        click.echo(f"wrote {out}")


def summary(found: dict) -> str:
    """A few lines per model for the terminal: greedy agreement, KV tokens, the speeds."""
    s = found["settings"]
    lines = [f"vLLM {found['engine']['version']}, {s['dtype']}, KV cache memory {s['kv_budget_bytes']:,} bytes, "
             f"context {s['context']}:"]  # fmt: skip
    ratios = {row["label"]: row for row in found["comparison"]}
    for m in found["models"]:
        kv, g = m["kv"], m["greedy"]
        line = (
            f"  {m['label']} ({m['kv_heads']} kv heads): greedy = transformers on {g['equal']}/{len(g['prompts'])} "
            f"prompts; KV {kv['engine']['tokens'] or 0:,} tokens (formula {kv['formula']['tokens']:,}), "
            f"max concurrency {kv['engine']['max_concurrency'] or 0:.2f}x"
        )
        if m["label"] in ratios:
            r = ratios[m["label"]]
            line += (
                f"; {r['kv_tokens_ratio'] or 0:.3f}x the parent's KV tokens (formula {r['formula_ratio']:.3f}x), "
                f"follows the parent for {g['follows_parent_mean']:.1f} of {s['greedy_tokens']} tokens"
            )
        lines.append(line)
        if m.get("decode"):
            d = m["decode"]
            lines.append(
                f"    decode-only at concurrency {d['concurrency']}: {d['tpot_ms'] or 0:,.1f} ms per output token "
                f"(inter-token {d['itl_ms'] or 0:,.1f} ms)" + _speedup(ratios.get(m["label"]), "decode_tpot_speedup")
            )
        if m.get("capacity"):
            c = m["capacity"]
            lines.append(
                f"    capacity-bound at concurrency {c['concurrency']} (fits {m['fits_requests']}): "
                f"{c['output_tokens_per_s']:,.1f} output tok/s, the engine ran {c['running_max'] or 0:.0f} at once"
                + _speedup(ratios.get(m["label"]), "capacity_throughput_ratio")
            )
        for p in m["throughput"]:
            lines.append(
                f"    concurrency {p['concurrency']}: {p['output_tokens_per_s']:,.1f} output tok/s, "
                f"{p['tpot_ms'] or 0:,.1f} ms per output token, {p['ttft_ms']:,.0f} ms to the first"
            )
    if found.get("settle"):
        q = found["settle"]
        lines.append(f"  servers {'quiet' if q['settled'] else 'NOT quiet'} after {q['waited_s']:.0f} s before timing")
    if s.get("capacity_concurrency") is None and s.get("capacity_concurrency_why"):
        lines.append(f"  capacity-bound point left out: {s['capacity_concurrency_why']}")
    return "\n".join(lines)


def _speedup(row: dict | None, key: str) -> str:
    return f"; {row[key]:.2f}x the parent's" if row and row.get(key) else ""
