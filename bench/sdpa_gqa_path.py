"""Which way the installed transformers hands grouped K/V to SDPA, per cache and phase: a tiny GQA Llama (8 query
heads, 2 kv heads, random weights) runs a prefill and one decode step with a DynamicCache (no mask) and with a
StaticCache (a mask over its slots), and each layer's route is counted:

  enable_gqa  SDPA reads the grouped K/V as they are (torch's enable_gqa=True)
  pack_gqa    one query token: the query heads are folded onto the kv heads, the K/V read as they are
  repeat_kv   the K/V copied out to every query head first: the step reads as much cache as MHA's

Why: bench/eval_gpu.py's graph variant (StaticCache, one captured decode step) gained 1.04x from GQA-8 on an
H200 (docs/benchmarks.md); whether the grouped cache is read as it is decides where that time can go. The
route is chosen by transformers' sdpa_attention_forward from the mask and the query length, the same way on
CPU and CUDA (XPU and MPS aside), so this runs anywhere in a second.

    python bench/sdpa_gqa_path.py [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import transformers
import transformers.integrations.sdpa_attention as sdpa
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mha2gqa.architecture.hfcache import cache_kwargs, cache_of

CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=128)  # fmt: skip


def count_routes(model, cache, ids) -> dict[str, dict[str, int]]:
    """{"prefill": counts, "decode": counts}: each layer's route (module docstring) in each phase."""
    routes = Counter()
    real = sdpa.repeat_kv, sdpa.pack_gqa, sdpa.torch.nn.functional.scaled_dot_product_attention

    def repeat_kv(states, n_rep):
        routes["repeat_kv"] += n_rep > 1
        return real[0](states, n_rep)

    def pack_gqa(states, n_rep):
        routes["pack_gqa"] += states is not None and states.shape[1] != 1  # the query (and a per-head mask)
        return real[1](states, n_rep)

    def attention(*args, **kwargs):
        routes["enable_gqa"] += bool(kwargs.get("enable_gqa"))
        return real[2](*args, **kwargs)

    sdpa.repeat_kv, sdpa.pack_gqa, sdpa.torch.nn.functional.scaled_dot_product_attention = (
        repeat_kv,
        pack_gqa,
        attention,
    )
    phases = {}
    try:
        with torch.no_grad():
            output = model(ids, use_cache=True, **cache_kwargs(model, cache))
            phases["prefill"] = {route: n for route, n in routes.items() if n}
            routes.clear()
            model(ids[:, -1:], use_cache=True, **cache_kwargs(model, cache_of(output)))
            phases["decode"] = {route: n for route, n in routes.items() if n}
    finally:
        sdpa.repeat_kv, sdpa.pack_gqa, sdpa.torch.nn.functional.scaled_dot_product_attention = real
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the counts as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(config.vocab_size, (4, 16))
    result = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "layers": config.num_hidden_layers,
        "caches": {
            "dynamic": count_routes(model, None, ids),
            "static": count_routes(model, StaticCache(config=config, max_cache_len=40), ids),
        },
    }
    for cache, phases in result["caches"].items():
        for phase, routes in phases.items():
            taken = ", ".join(f"{route} {layers}" for route, layers in sorted(routes.items()))
            print(f"{cache:8s} {phase:8s} {taken or 'no grouped route'}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
