"""Tables and plots of the ablation grid written by mha2gqa.reproduce."""

from __future__ import annotations

from pathlib import Path

MARKERS = {"mean": "o", "first": "s", "random": "^"}


def markdown_table(table: dict) -> str:
    rows = table["rows"]
    alphas = sorted({r["alpha"] for r in rows if not r["method"].startswith("parent")})
    parent = next(r for r in rows if r["method"].startswith("parent"))
    head = "| method | kv heads | " + " | ".join(f"alpha={a:g}" for a in alphas) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(alphas)]
    lines.append(f"| parent (MHA) | {parent['kv_heads']} | {parent['perplexity']:.2f}" + " |" + " |" * (len(alphas) - 1))
    cells = sorted({(r["method"], r["kv_heads"]) for r in rows if r is not parent}, key=lambda c: (c[0] != "mean", c))
    for method, kv in cells:
        by_alpha = {r["alpha"]: r["perplexity"] for r in rows if (r["method"], r["kv_heads"]) == (method, kv)}
        values = " | ".join(f"{by_alpha[a]:.2f}" if a in by_alpha else "" for a in alphas)
        lines.append(f"| {method} | {kv} | {values} |")
    exact = sorted({(r["alpha"], r["alpha_exact"]) for r in rows if r is not parent and "alpha_exact" in r})
    note = ", ".join(f"{a:g} = {100 * e:.2f}%" for a, e in exact)
    lines += ["", f"Held-out perplexity ({table['eval']}). Alphas as run (whole optimizer steps): {note}."]
    return "\n".join(lines) + "\n"


def plot(table: dict, out_dir: Path, kv_bytes_per_head: int) -> list[Path]:
    """perplexity_vs_alpha.png (one panel per kv-head count) and quality_vs_kv.png."""
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
        points = sorted((r["kv_heads"] * kv_bytes_per_head, r["perplexity"]) for r in rows
                        if r["alpha"] == alpha and r["method"] == "mean")
        ax.plot([x / 1024 for x, _ in points], [p for _, p in points], marker="o", label=f"mean, alpha={alpha:g}")
    ax.scatter([parent["kv_heads"] * kv_bytes_per_head / 1024], [parent["perplexity"]], color="black", marker="*",
               s=120, label="parent (MHA)", zorder=3)
    ax.set_xlabel("KV cache per token (KiB, fp32)")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    second = out_dir / "quality_vs_kv.png"
    fig.savefig(second, dpi=120)
    plt.close(fig)
    return [first, second]
