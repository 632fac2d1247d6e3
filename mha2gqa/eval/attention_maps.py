"""Per-head attention maps of one layer on a short text, the parent's heads beside the model's.

sdpa returns no attention weights, so the models run under eager attention for this one forward
and are switched back afterwards.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mha2gqa.errors import InputError

PAIRS_PER_ROW = 4  # head i of the reference beside head i of the model: 8 panels a row


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
    ids = tokenizer(text, return_tensors="pt")["input_ids"]  # (1, T)
    if not 2 <= ids.shape[1] <= 256:
        raise InputError(f"--attention-maps text is {ids.shape[1]} tokens: use a short text of 2..256 tokens")
    maps = {"model": layer_attention(model, ids, layer)}
    if reference is not None:
        maps["reference"] = layer_attention(reference, ids, layer)
    return {"maps": maps, "tokens": tokenizer.convert_ids_to_tokens(ids[0].tolist()), "layer": layer % n_layers}


def plot_attention_maps(found: dict, out_png: Path, labels: dict[str, str], kv_heads: int) -> Path:
    """A PNG grid: for each query head, the reference's map (when given) then the model's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    maps = found["maps"]
    heads = maps["model"].shape[0]
    per_head = [k for k in ("reference", "model") if k in maps]
    cols = PAIRS_PER_ROW * len(per_head)
    rows = math.ceil(heads * len(per_head) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.1 * cols, 2.3 * rows + 0.6), squeeze=False)
    group = max(1, heads // kv_heads)  # query head i reads kv head i // group
    for i in range(heads):
        for j, key in enumerate(per_head):
            slot = i * len(per_head) + j
            ax = axes[slot // cols][slot % cols]
            ax.imshow(maps[key][i].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            kv = f", kv {i // group}" if key == "model" else ""
            ax.set_title(f"{labels[key]}\nhead {i}{kv}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    for slot in range(heads * len(per_head), rows * cols):
        axes[slot // cols][slot % cols].axis("off")
    fig.suptitle(
        f"Attention probabilities of layer {found['layer']} ({len(found['tokens'])} tokens; "
        "rows: query position, columns: key position; colour 0 (dark) to 1 (yellow))",
        fontsize=10,
    )
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
