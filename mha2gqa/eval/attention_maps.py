"""Per-head attention maps of one layer on a short text, the parent's heads beside the model's.

sdpa returns no attention weights, so the models run under eager attention for this one forward
and are switched back afterwards.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mha2gqa.corpus.tokens import stream_ids
from mha2gqa.runtime.errors import InputError

PAIRS_PER_ROW = 4  # head i of the reference beside head i of the model: 8 panels a row (short texts)


@torch.no_grad()
def layer_attention(model, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """(H, T, T) attention probabilities of `layer` for ids (1, T)."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(ids.to(next(model.parameters()).device), output_attentions=True)
    finally:
        model.set_attn_implementation(before)
    return out.attentions[layer][0].float().cpu()


def attention_maps(model, tokenizer, text: str, layer: int, reference=None) -> dict:
    n_layers = model.config.num_hidden_layers
    if not -n_layers <= layer < n_layers:
        raise InputError(
            f"--attention-layer {layer} is out of range: the model has {n_layers} layers (0..{n_layers - 1})"
        )
    ids = stream_ids(text, tokenizer)[None]  # (1, T)
    if not 2 <= ids.shape[1] <= 256:
        raise InputError(f"--attention-maps text is {ids.shape[1]} tokens: use a short text of 2..256 tokens")
    maps = {"model": layer_attention(model, ids, layer)}
    if reference is not None:
        maps["reference"] = layer_attention(reference, ids, layer)
    return {"maps": maps, "tokens": tokenizer.convert_ids_to_tokens(ids[0].tolist()), "layer": layer % n_layers}


MAX_LABELLED_TOKENS = 48  # beyond this, every k-th token is labelled so the labels stay readable


def token_labels(tokens: list[str]) -> list[str]:
    """Tokens as a reader sees them: the byte-level BPE space (Ġ) and newline (Ċ) and sentencepiece's ▁
    shown as a visible space and ↵, long ones cut."""
    shown = [t.replace("Ġ", "␣").replace("▁", "␣").replace("Ċ", "↵") for t in tokens]
    return [t if len(t) <= 10 else t[:9] + "…" for t in shown]


def plot_attention_maps(found: dict, out_png: Path, labels: dict[str, str], kv_heads: int) -> Path:
    """The PNG of attention_figure."""
    import matplotlib.pyplot as plt

    fig = attention_figure(found, labels, kv_heads)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def attention_figure(found: dict, labels: dict[str, str], kv_heads: int):
    """A grid: for each query head, the reference's map (when given) then the model's; query tokens
    down the left column, key tokens along the bottom row, one colour scale (the bar) for all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    maps = found["maps"]
    heads = maps["model"].shape[0]
    per_head = [k for k in ("reference", "model") if k in maps]
    tokens = token_labels(found["tokens"])
    n = len(tokens)
    cols = (PAIRS_PER_ROW if n <= 12 else 2) * len(per_head)  # fewer, larger panels for longer texts
    rows = math.ceil(heads * len(per_head) / cols)
    step = max(1, math.ceil(n / MAX_LABELLED_TOKENS))
    ticks = list(range(0, n, step))
    size = 2.1 if n <= 12 else 2.8 if n <= 24 else 3.6  # panels grow so that labelled tokens fit
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols + 1.2, size * rows + 1.0), squeeze=False)
    font = 7 if n <= 24 else 6
    # Attention spreads thin over long texts: a square-root scale keeps small probabilities visible,
    # and the bar shows the real values.
    norm = matplotlib.colors.PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    group = max(1, heads // kv_heads)  # query head i reads kv head i // group
    image = None
    for i in range(heads):
        for j, key in enumerate(per_head):
            slot = i * len(per_head) + j
            ax = axes[slot // cols][slot % cols]
            image = ax.imshow(maps[key][i].numpy(), cmap="viridis", norm=norm)
            kv = f", kv {i // group}" if key == "model" else ""
            ax.set_title(f"{labels[key]}\nhead {i}{kv}", fontsize=8)
            ax.set_xticks(
                ticks, [tokens[t] for t in ticks] if slot // cols == rows - 1 else [], rotation=90, fontsize=font
            )
            ax.set_yticks(ticks, [tokens[t] for t in ticks] if slot % cols == 0 else [], fontsize=font)
    for slot in range(heads * len(per_head), rows * cols):
        axes[slot // cols][slot % cols].axis("off")
    fig.suptitle(
        f"Attention probabilities of layer {found['layer']} ({n} tokens; rows: query token, columns: key token)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 0.94, 1))
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.02, pad=0.01)
    bar.set_label("attention probability (square-root scale)", fontsize=8)
    return fig
