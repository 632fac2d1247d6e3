"""transformers' greedy decode of the same prompts: the text an engine's greedy decode must equal.

A loop of argmax steps over the KV cache rather than `generate`: it decodes exactly `tokens` tokens (the
engine is asked to ignore the end-of-text token too) and applies none of generation_config.json's defaults
(repetition penalty, sampling), which the server is told to ignore as well (--generation-config vllm).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mha2gqa.architecture.hfcache import cache_kwargs, cache_of
from mha2gqa.eval.model import DTYPES, load_model


@torch.no_grad()
def greedy_ids(model, prompt: list[int], tokens: int) -> list[int]:
    """`tokens` greedy continuation ids of `prompt` (one sequence, batch 1: no padding to differ on)."""
    ids = torch.tensor([prompt])  # (1, T)
    out = model(ids, use_cache=True)
    found = []
    for _ in range(tokens):
        nxt = out.logits[:, -1].argmax(-1)  # (1,)
        found.append(int(nxt))
        out = model(nxt[:, None], use_cache=True, **cache_kwargs(model, cache_of(out)))
    return found


def reference_texts(model_dir: Path, dtype: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The model's greedy continuation of each prompt in `dtype`, on the CPU."""
    model = load_model(Path(model_dir), DTYPES[dtype], torch.device("cpu"), progress=False)
    try:
        return [greedy_ids(model, prompt, tokens) for prompt in prompts]
    finally:
        del model
