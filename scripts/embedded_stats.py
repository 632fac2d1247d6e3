"""Numbers that describe the embedded default, measured on held-out Persuasion.

    python scripts/embedded_stats.py                    # unigram baseline, model perplexity, head similarity
    python scripts/embedded_stats.py --max-tokens 16384 --pooled 4,2,1 --json stats.json

- unigram: perplexity of an add-one smoothed unigram model (token counts of the five training
  novels, same tokenizer): the bar the trained model must clear by 3x.
- model: perplexity of the embedded model, non-overlapping windows of --block tokens.
- heads: per layer, mean pairwise cosine similarity of the k and v heads (each head's weight rows
  flattened into one vector). Near 0 means the heads are distinct, so pooling them loses something.
- --pooled G: perplexity after mean-pooling k/v heads into G groups (simulated in the MHA layout:
  every head of a group gets the group mean), to show that conversion is lossy before uptraining.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from mha2gqa.convert.methods import group_heads, group_mean  # noqa: E402
from mha2gqa.files import embedded  # noqa: E402
from mha2gqa.scoring.perplexity import perplexity  # noqa: E402


def novel_ids(tokenizer, name: str) -> torch.Tensor:
    """A whole novel as one stream of token ids (no special tokens), shape (N,)."""
    return torch.tensor(tokenizer.backend_tokenizer.encode(embedded.read_novel(name)).ids)


def unigram_perplexity(train_ids: list[torch.Tensor], eval_ids: torch.Tensor, vocab_size: int) -> float:
    """Add-one smoothed unigram model: p(t) = (count(t) + 1) / (N + V)."""
    counts = sum(torch.bincount(ids, minlength=vocab_size) for ids in train_ids).double()  # (V,)
    log_p = torch.log((counts + 1) / (counts.sum() + vocab_size))  # (V,)
    return math.exp(-log_p[eval_ids].mean().item())


def model_perplexity(model, ids: torch.Tensor, block: int, batch: int = 8) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of `block` tokens: the package's
    sliding-window perplexity with stride == context (each window starts with an empty context, as in
    training, and its first token is not scored)."""
    return perplexity(model, ids, context=block, stride=block, batch_size=batch, progress=True)["perplexity"]


def _heads(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    # (n_heads * hd, d) -> (n_heads, hd * d): one flattened vector per head
    return weight.reshape(n_heads, -1)


def head_similarity(model) -> list[dict]:
    """Per layer: mean pairwise cosine similarity of the k heads and of the v heads."""
    n_kv = model.config.num_key_value_heads
    rows = []
    for i, layer in enumerate(model.model.layers):
        row = {"layer": i}
        for name in ("k_proj", "v_proj"):
            unit = F.normalize(_heads(getattr(layer.self_attn, name).weight.float(), n_kv), dim=1)
            cos = unit @ unit.T  # (n_kv, n_kv)
            pairs = torch.triu_indices(n_kv, n_kv, offset=1)
            row[name[0]] = cos[pairs[0], pairs[1]].mean().item()
        rows.append(row)
    return rows


@torch.no_grad()
def mean_pooled(model, groups: int):
    """A copy whose k/v heads are replaced by their group means (kv head j is in group j // r), with the
    package's pooling: the MHA-layout twin of `mha2gqa convert --method mean --groups G`."""
    pooled = copy.deepcopy(model)
    n_kv = model.config.num_key_value_heads
    for layer in pooled.model.layers:
        for name in ("k_proj", "v_proj"):
            proj = getattr(layer.self_attn, name)
            for param in (proj.weight, proj.bias):
                if param is not None:
                    grouped = group_heads(param, n_kv, groups)  # (G, r, hd, ...)
                    param.copy_(group_mean(grouped)[:, None].expand_as(grouped).reshape(param.shape))
    return pooled


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=str(embedded.model_dir()), help="model directory (default: the embedded model)"
    )
    parser.add_argument(
        "--block", type=int, default=512, help="window length for perplexity (default 512, the training block)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=0, help="evaluate on the first N tokens of Persuasion only (0: all)"
    )
    parser.add_argument("--pooled", default="", help="comma-separated kv group counts to mean-pool into, e.g. 4,2,1")
    parser.add_argument("--json", default="", help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(embedded.tokenizer_dir())
    vocab = len(tokenizer)
    train_ids = [novel_ids(tokenizer, name) for name in embedded.TRAIN_NOVELS]
    eval_ids = novel_ids(tokenizer, embedded.HELDOUT_NOVEL)
    if args.max_tokens:
        eval_ids = eval_ids[: args.max_tokens]
    stats = {"eval_tokens": len(eval_ids), "train_tokens": sum(len(t) for t in train_ids), "vocab": vocab}
    stats["unigram_ppl"] = unigram_perplexity(train_ids, eval_ids, vocab)
    print(f"Persuasion: {len(eval_ids)} tokens; training novels: {stats['train_tokens']} tokens; vocab {vocab}")
    print(f"unigram (add-one) perplexity: {stats['unigram_ppl']:.1f}")

    if os.path.isfile(os.path.join(args.model, "config.json")):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        stats["model_ppl"] = model_perplexity(model, eval_ids, args.block)
        stats["ratio"] = stats["model_ppl"] / stats["unigram_ppl"]
        print(f"model perplexity: {stats['model_ppl']:.2f} ({stats['ratio']:.3f} x unigram; acceptance: <= 0.333)")
        stats["heads"] = head_similarity(model)
        print("mean pairwise cosine similarity of heads (k, v):")
        for row in stats["heads"]:
            print(f"  layer {row['layer']}: k {row['k']:+.3f}  v {row['v']:+.3f}")
        for groups in [int(g) for g in args.pooled.split(",") if g]:
            ppl = model_perplexity(mean_pooled(model, groups), eval_ids, args.block)
            stats[f"pooled_{groups}_ppl"] = ppl
            print(f"k/v mean-pooled to {groups} group(s), no uptraining: perplexity {ppl:.2f}")
    else:
        print(f"no model at {args.model} yet: unigram baseline only")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(stats, fh, indent=2)


if __name__ == "__main__":
    main()
