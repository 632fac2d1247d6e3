"""What dominates the error of a merged real model (docs/refine.md, "On a real model"): per layer, the first
token's share of the attention-output error and of the residual-stream error, the massive activations,
and the share of the KL by position, on 4 blocks of Persuasion.

    python bench/refine_real_positions.py MERGED      # SMOLLM2=DIR for the parent (default /work/real-models/smollm2)
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrated_merge import heldout_ids  # noqa: E402
from refine_real import real_model_from_env  # noqa: E402


def run(model, ids):
    """Logits, hidden states and each layer's attention output."""
    attn = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda mod, a, out, i=i: attn.__setitem__(i, out[0]))
        for i, layer in enumerate(model.model.layers)
    ]
    out = model(ids, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    return out.logits, out.hidden_states, attn


def main() -> None:
    torch.set_grad_enabled(False)
    src = real_model_from_env()
    ids = heldout_ids(src, None, 4 * 512).view(4, 512)
    parent = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    lp, hp, ap = run(parent, ids)
    lc, hc, ac = run(merged, ids)
    print("hidden-state max |x| by position (parent):")
    for index in (1, 5, 15, 29):
        peak, rms = hp[index].abs().amax(-1), hp[index].pow(2).mean(-1).sqrt()  # (B, S)
        print(
            f" L{index}: first token max {peak[:, 0].mean():.1f} rms {rms[:, 0].mean():.2f}; others max median "
            f"{peak[:, 1:].median():.2f} top {peak[:, 1:].max():.1f} rms {rms[:, 1:].mean():.2f}; "
            f"later tokens with max > 100: {(peak[:, 1:] > 100).sum().item()}"
        )
    print("per layer: first token's share of the attention-output error and of the residual error")
    for index in range(len(parent.model.layers)):
        e, t = (ac[index] - ap[index]).pow(2).sum(-1), ap[index].pow(2).sum(-1)
        r, h = (hc[index + 1] - hp[index + 1]).pow(2).sum(-1), hp[index + 1].pow(2).sum(-1)
        print(
            f" L{index:2d}: attention error share {e[:, 0].sum() / e.sum():.3f}, relative {e.sum() / t.sum():.3f} | "
            f"residual error share {r[:, 0].sum() / r.sum():.3f}, relative {r.sum() / h.sum():.3f}, "
            f"without the first token {r[:, 1:].sum() / h[:, 1:].sum():.3f}, per-token {(r / h)[:, 1:].mean():.3f}"
        )
    target = lp.log_softmax(-1)
    kl = (target.exp() * (target - lc.log_softmax(-1))).sum(-1)  # (B, S)
    quarters = [round(float(kl[:, i * 128 : (i + 1) * 128].mean()), 3) for i in range(4)]
    print(
        f"KL mean {kl.mean():.3f}; first token's share {kl[:, 0].sum() / kl.sum():.3f}; first 8 positions' "
        f"{kl[:, :8].sum() / kl.sum():.3f}; by quarter of the block {quarters}"
    )


if __name__ == "__main__":
    main()
