"""Calibration text sampled from the parent itself (`--calibration parent`): the data a user always has.

A compressed model keeps what its calibration text exercises; text the parent writes is drawn from the
parent's own distribution, so it exercises what the parent knows, in proportion, with no data of the
user's (self-calibration, NAACL 2025; LLM-QAT, 2023, for the recipe). The recipe (SamplingRecipe):
each sequence starts from a token drawn uniformly from the vocabulary (special tokens left out), the next
few are greedy (a random start is often no word; the greedy tokens settle it into text), then tokens are
sampled at temperature 1 with nucleus top-p, the parent's own distribution without its far tail.
Sequences are as long as the calibration blocks, batched, with the KV cache.

Deterministic: one torch.Generator on the CPU seeded by --seed draws every random number, from logits
moved to the CPU in float32; on CPU the same seed gives the same ids (tests check the sha256). A GPU's
logits differ in their last bits from the CPU's, so its samples are another (equally valid) set; the
record says which device drew them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SamplingRecipe:
    """How --calibration parent draws its text (the defaults were chosen by measurement, docs/calibration.md)."""

    greedy_tokens: int = 3
    """Tokens after the random first one taken greedily (the most likely), before sampling starts."""
    temperature: float = 1.0
    """Softmax temperature of the sampled tokens (1: the parent's distribution)."""
    top_p: float = 0.95
    """Nucleus sampling: draw from the smallest set of tokens holding this much probability."""
    batch: int = 16
    """Sequences generated at once."""

    def describe(self) -> str:
        return (
            f"a random first token, {self.greedy_tokens} greedy, then sampled at temperature {self.temperature:g}, "
            f"top-p {self.top_p:g}"
        )

    def record(self) -> dict:
        return asdict(self)


DEFAULT_RECIPE = SamplingRecipe()
NUCLEUS_CANDIDATES = 1024  # tokens the top-p nucleus is looked for among first (_draw)


def flops(params: int, tokens: int) -> float:
    """About 2 FLOPs a parameter a token: one forward per sampled token (the cache saves the rest)."""
    return 2.0 * params * tokens


def cache_bytes(config: dict, shape, seq_len: int, recipe: SamplingRecipe = DEFAULT_RECIPE) -> int:
    """Memory beyond the model while sampling, float32: the KV cache of a batch of full sequences and a few
    vocabulary-wide rows per sequence."""
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else 0
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * seq_len * recipe.batch * 4
    return kv + 4 * recipe.batch * vocab * 4


def first_token_pool(tokenizer, vocab_size: int):
    """The ids a sequence may start from: every id of the model's vocabulary that the tokenizer knows
    and that is no special token (BOS/EOS/pad/chat markers would start or end a document)."""
    import torch

    special = set(tokenizer.all_special_ids)
    known = min(vocab_size, len(tokenizer))
    return torch.tensor([i for i in range(known) if i not in special], dtype=torch.long)


def sample_ids(model, tokenizer, tokens: int, seq_len: int, seed: int, recipe=DEFAULT_RECIPE, progress=True):
    """`tokens` ids (N,) sampled from `model` (a loaded causal LM), in sequences of `seq_len`."""
    import torch
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(seed)
    pool = first_token_pool(tokenizer, model.config.vocab_size)
    sequences = -(-tokens // seq_len)
    device = next(model.parameters()).device
    out = []
    with tqdm(total=sequences * seq_len, desc="sample", unit="tok", unit_scale=True, disable=not progress) as bar:
        for start in range(0, sequences, recipe.batch):
            batch = min(recipe.batch, sequences - start)
            first = pool[torch.randint(len(pool), (batch,), generator=generator)]
            out.append(_sample_batch(model, first, seq_len, recipe, generator, device, bar))
    return torch.cat(out).reshape(-1)[:tokens]


def _sample_batch(model, first, seq_len: int, recipe: SamplingRecipe, generator, device, bar):
    """(B,) first tokens -> (B, seq_len) sequences, one forward a token through the KV cache."""
    import torch

    ids = [first]
    cache, step_input = None, first[:, None].to(device)
    bar.update(len(first))
    with torch.no_grad():
        for position in range(1, seq_len):
            output = model(step_input, cache=cache, use_cache=True, logits_to_keep=1)
            cache = output.cache
            logits = output.logits[:, -1].float().cpu()  # (B, V): drawn on the CPU, the same on every device
            chosen = logits.argmax(-1) if position <= recipe.greedy_tokens else _draw(logits, recipe, generator)
            ids.append(chosen)
            step_input = chosen[:, None].to(device)
            bar.update(len(first))
    return torch.stack(ids, dim=1)


def _draw(logits, recipe: SamplingRecipe, generator):
    """One token per row from softmax(logits / T), restricted to the top-p nucleus. The nucleus is looked
    for among the NUCLEUS_CANDIDATES likeliest tokens (a top-k, far cheaper than sorting the vocabulary);
    a row whose nucleus is wider than that (a flat distribution) is sorted in full."""
    import torch

    probs = torch.softmax(logits / recipe.temperature, dim=-1)  # (B, V) float32
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    ordered, order = probs.topk(k, dim=-1)  # descending
    wide = ordered.sum(-1) < recipe.top_p
    if bool(wide.any()):
        ordered, order = probs.sort(dim=-1, descending=True)
    ordered = ordered.clone()
    ordered[ordered.cumsum(-1) - ordered > recipe.top_p] = 0.0  # tokens after the nucleus is full
    picked = torch.multinomial(ordered, 1, generator=generator).squeeze(1)
    return order.gather(1, picked[:, None]).squeeze(1)
