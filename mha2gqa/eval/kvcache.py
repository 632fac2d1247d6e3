"""KV-cache bytes per token: the formula against the live transformers cache after a prefill.

Some HF models store K/V already broadcast to every query head (falcon's new architecture did):
then the cache holds `heads` rows per layer, not `kv_heads`, GQA saves nothing, and we say so.

The bytes are counted per position a layer holds: a sliding-window layer (Mistral, Qwen2 with
use_sliding_window) keeps only its last positions once the prefill is longer than its window, and each of those
costs what the formula says; the window and the positions held are reported, and only bytes per position that
differ from the formula are a mismatch.
"""

from __future__ import annotations

import torch

from mha2gqa.architecture.hfcache import cache_of
from mha2gqa.architecture.layouts import AttentionShape


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a transformers 5 Cache; layers never written are skipped."""
    pairs = []
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            pairs.append((layer.keys, layer.values))
    return pairs


def measure_kv_cache(model, shape: AttentionShape, batch: int = 2, tokens: int = 32, seed: int = 0) -> dict:
    """Prefill `batch` x `tokens` random ids and compare the cache's bytes with the formula."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen).to(device)  # (B, T)
    with torch.no_grad():
        cache = cache_of(model(ids, use_cache=True))
    pairs = cache_tensors(cache)
    # keys, values: (B, n_kv, S, hd); S below `tokens` in a sliding-window layer past its window
    per_token = sum(
        (k.numel() * k.element_size() + v.numel() * v.element_size()) / (batch * k.shape[2]) for k, v in pairs
    )
    held = min((int(k.shape[2]) for k, _ in pairs), default=tokens)
    dtype_bytes = pairs[0][0].element_size() if pairs else torch.tensor([], dtype=model.dtype).element_size()
    formula = shape.kv_bytes_per_token(dtype_bytes=dtype_bytes)
    # keys: (B, n_kv, S, hd) in every transformers 5 cache layer.
    cached_heads = sorted({int(k.shape[1]) for k, _ in pairs})
    result = {
        "formula_bytes_per_token": formula,
        "measured_bytes_per_token": per_token,
        "match": per_token == formula,
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "cached_heads": cached_heads,
        "head_dim": shape.head_dim,
        "dtype_bytes": dtype_bytes,
        "prefill_batch": batch,
        "prefill_tokens": tokens,
        "cache_class": type(cache).__name__,
    }
    if held < tokens:  # the window, where a layer held fewer positions than the prefill gave it
        result.update(cached_positions=held, sliding_window=getattr(model.config, "sliding_window", None))
    if not result["match"]:
        result["warning"] = mismatch_message(result)
    return result


def mismatch_message(r: dict) -> str:
    why = ""
    if r["cached_heads"] and max(r["cached_heads"]) > r["kv_heads"]:
        why = (
            f" The cache holds {max(r['cached_heads'])} heads per layer, not {r['kv_heads']}: this model "
            "broadcasts K/V to every query head before caching, so fewer kv heads save no memory here."
        )
    return (
        f"KV CACHE MISMATCH: the live cache holds {r['measured_bytes_per_token']:g} bytes/token, the formula "
        f"2*layers*kv_heads*head_dim*bytes gives {r['formula_bytes_per_token']}.{why}"
    )
