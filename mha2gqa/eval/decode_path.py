"""How a timed decode step reads a grouped KV cache: the attention path `eval --decode-path` picks.

GQA saves decode time only where a step reads each cached kv head once for its whole group. What
transformers does by default does not always (docs/eval.md, "Decode path"; measured in docs/benchmarks.md):

  grouped  (default) a StaticCache sized for the prompt and the new tokens, written in place (no copy of
           the cache per step), and the attention function GROUPED registered with transformers'
           AttentionInterface: a one-token step folds the query heads onto the kv heads, (B, H, 1, D) ->
           (B, Hkv, H/Hkv, D), and attends on the cached K/V as they are: no copy to the query-head count,
           and the kernel's work per kv head covers its whole group. The kernel (`kernel_on`): on CPU in bfloat16
           and float32 the fused one (decode_kernel.py: each kv head read once for its group, the softmax in
           between, in one loop nest) where the machine builds it; else, and in float16, two batched matrix
           products around a softmax (`matmul_attention`) in 16-bit dtypes and SDPA in float32; elsewhere SDPA.
           Prefill, and any step it does not handle (softcap, attention sinks, a position bias), go to
           transformers' own SDPA function.
  dynamic  the path eval took before: transformers' DynamicCache, whose update concatenates the whole cache
           into a new tensor every step, and the model's attention as loaded (SDPA: enable_gqa when the step
           has no mask, every query head then reading its kv head on its own).
  repeat   DynamicCache and transformers' eager attention: K/V copied out to every query head each step
           (repeat_kv), as a compiled static cache does (transformers' SDPA under torch.compile): GQA's
           smaller cache is read, then copied to MHA's size.

Nothing of transformers is patched: GROUPED is registered under its own name and set on the model for the
timed decode only (`decode_attention`), the model's own implementation restored after. It is set only on a
model that runs SDPA (what it hands on to); a model loaded with another attention (eager for a logit softcap)
keeps it on the static cache, and the result's `attention` says so.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from mha2gqa.eval import decode_kernel
from mha2gqa.eval.options import DecodePath

GROUPED = "mha2gqa_grouped"


# One line each, for a user who asked for a path that gives GQA's decode saving away (eval warns at start).
SLOW_FOR_GQA = {
    DecodePath.DYNAMIC: "copies the whole KV cache every step and has every query head read its kv head on its own",
    DecodePath.REPEAT: "copies K/V out to every query head every step, reading as much as MHA's cache",
}

# What each path copies per step besides the new token's K/V (the JSON's `copied_per_step`).
COPIED = {
    DecodePath.GROUPED: None,
    DecodePath.DYNAMIC: "the whole cache at the kv-head count (DynamicCache's torch.cat)",
    DecodePath.REPEAT: "the whole cache (torch.cat), then K/V out to the query-head count (repeat_kv)",
}

ROUTES: Counter = Counter()
"""One-token attention calls (one a layer a step) GROUPED took, by route: folded (query heads onto kv heads),
as_is (one query head per kv head: nothing to fold), handed_on (to transformers' SDPA). Reset by
`decode_attention`."""


def _handled_here(query: torch.Tensor, kwargs: dict) -> bool:
    """A one-token step with nothing GROUPED does not do (a logit softcap, attention sinks, a position bias)."""
    return query.shape[2] == 1 and all(kwargs.get(k) is None for k in ("softcap", "s_aux", "position_bias"))


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: query (B, H, q, D), key/value (B, Hkv, T, D) as cached;
    returns ((B, q, H, D), None)."""
    if not _handled_here(query, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if query.shape[2] == 1:
            ROUTES["handed_on"] += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    batch, heads, _, _ = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    ROUTES["folded" if group > 1 else "as_is"] += 1
    folded = query.reshape(batch, kv_heads, group, query.shape[-1])  # the group's query heads as rows
    mask = attention_mask
    if mask is not None and mask.shape[1] != 1:  # a per-head mask folds as the query does
        mask = mask.reshape(mask.shape[0], kv_heads, group, mask.shape[-1])
    out = KERNELS[kernel_for(folded, key, value)](folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


CPU_KERNEL = {"name": "auto"}
"""The folded step's kernel on CPU: "auto" (the fastest measured on this CPU for the dtype: the fused kernel in
bfloat16 and float32 where it builds, else `matmul_attention` in bfloat16 and float16, where PyTorch's CPU SDPA
reads K/V at a quarter of its pace with one query row, and SDPA in float32), or "fused", "matmul", "sdpa" (the
decode benchmark times each: its paths grouped-fused, grouped-matmul, grouped-sdpa)."""


def kernel_on(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel a folded step on `device` in `dtype` runs: "fused", "matmul" or "sdpa"."""
    if device.type != "cpu":
        return "sdpa"
    if CPU_KERNEL["name"] != "auto":
        return CPU_KERNEL["name"]
    if dtype in decode_kernel.DTYPES and decode_kernel.available():
        return "fused"
    return _pytorch_kernel(dtype)


def _pytorch_kernel(dtype: torch.dtype) -> str:
    """The faster PyTorch kernel for a folded CPU step in `dtype`, where the fused one does not run."""
    return "sdpa" if dtype == torch.float32 else "matmul"


def kernel_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str:
    """`kernel_on`'s choice for this step, the fused kernel only where it takes the tensors (a head size over
    256, rows not contiguous: the dtype's PyTorch kernel instead)."""
    kernel = kernel_on(query.device, query.dtype)
    if kernel == "fused" and not decode_kernel.takes(query, key, value):
        return _pytorch_kernel(query.dtype)
    return kernel


def matmul_attention(query, key, value, attn_mask=None, scale=None):
    """SDPA's result for a few query rows per kv head, as two batched matrix products around a softmax: on CPU
    they read K and V at the bandwidth's pace, where PyTorch's CPU SDPA kernel, made for long queries, reads
    them several times slower with one or four rows (docs/benchmarks.md, "Decode on CPU"). query (B, Hkv, r, D),
    key/value (B, Hkv, T, D) as cached (K read transposed in place, not copied). The scores (B, Hkv, r, T) are
    as large for GQA as for MHA, so they are passed over as few times as can be: the scale goes on the query,
    the mask and the softmax work in place or in one pass, all in the cache's dtype (the softmax sums in float32
    inside; in bfloat16 the scores and the weights are rounded to it, as a flash kernel rounds the weights)."""
    scaled = query * (query.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.matmul(scaled, key.transpose(-1, -2))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores.masked_fill_(attn_mask.logical_not(), float("-inf"))
    elif attn_mask is not None:
        scores.add_(attn_mask)
    return torch.matmul(torch.softmax(scores, -1), value)


KERNELS = {
    "fused": decode_kernel.fused_attention,
    "matmul": matmul_attention,
    "sdpa": F.scaled_dot_product_attention,
}


def register() -> None:
    """GROUPED in transformers' attention and mask registries (its masks are SDPA's); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED, grouped_attention)
    AttentionMaskInterface.register(GROUPED, sdpa_mask)


def new_cache(model, path: DecodePath | str, tokens: int):
    """The cache a decode on `path` starts from, room for `tokens` in all; None: transformers makes its own."""
    if DecodePath(path) != DecodePath.GROUPED:
        return None
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=tokens)


def _attention_for(path: DecodePath) -> str | None:
    return {DecodePath.GROUPED: GROUPED, DecodePath.REPEAT: "eager"}.get(path)


def _set_attention(model, name: str) -> None:
    """`name` as the model's attention; a model class that cannot switch keeps its own (the result's `attention`
    says which ran, and GROUPED's `steps` stay empty)."""
    try:
        model.set_attn_implementation(name)
    except (ValueError, KeyError, AttributeError, NotImplementedError):
        pass


@contextmanager
def decode_attention(models: list, path: DecodePath | str):
    """The models' attention set for `path` while the block runs, each model's own restored after; yields
    the path's description: its cache, the attention as set, what a step copies, and (GROUPED) the routes
    its one-token steps took, filled in on exit."""
    path = DecodePath(path)
    wanted = _attention_for(path)
    before = [m.config._attn_implementation for m in models]
    found = {"name": path.value, "cache": "static" if path == DecodePath.GROUPED else "dynamic"}
    if wanted == GROUPED:
        register()
    ROUTES.clear()
    try:
        for model in models:  # GROUPED hands on to SDPA: a model loaded without SDPA keeps its own attention
            if wanted is not None and (wanted != GROUPED or model.config._attn_implementation == "sdpa"):
                _set_attention(model, wanted)
        found["attention"] = ",".join(sorted({m.config._attn_implementation for m in models}))  # as set
        found["copied_per_step"] = COPIED[path]
        if wanted == GROUPED:
            found["kernel"] = ",".join(sorted({kernel_on(m.device, m.dtype) for m in models}))
        yield found
    finally:
        for model, own in zip(models, before):
            if model.config._attn_implementation != own:
                model.set_attn_implementation(own)
        if wanted == GROUPED:
            found["steps"] = dict(ROUTES)
