"""Calibration text sampled from the parent itself (`--calibration parent`): the data a user always has.

A compressed model keeps what its calibration text exercises; text the parent writes is drawn from the
parent's own distribution, so it exercises what the parent knows, in proportion, with no data of the
user's (self-calibration, NAACL 2025; LLM-QAT, 2023, for the recipe). The recipe (SamplingRecipe) has
two kinds of sequence, interleaved in proportion:
- a chat turn (`chat_share` of them, when the tokenizer has a chat template): the sequence opens with the
  template's header of a user turn and the model writes the request itself, then its own answer (Magpie,
  2024). An instruct model asked nothing writes requests of every kind, code among them, where a random
  start almost always settles into essay-like English (measured on SmolLM2, docs/calibration.md);
- a random start (the rest, or all without a template): a token drawn uniformly from the vocabulary
  (special tokens left out), the next few greedy (a random start is often no word; the greedy tokens
  settle it into text).
Then tokens are sampled at temperature 1 with nucleus top-p, the parent's own distribution without its
far tail. Sequences are as long as the calibration blocks, batched, with the KV cache.

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
    """Sequences generated at once (convert draws more at once where their KV cache is small: batch_for)."""
    chat_share: float = 0.5
    """Share of the sequences that open with the chat template's user-turn header (the model writes the
    request and the answer); 0, or a tokenizer without a chat template: every sequence starts at random."""

    def describe(self) -> str:
        return (
            f"a random first token, {self.greedy_tokens} greedy, then sampled at temperature {self.temperature:g}, "
            f"top-p {self.top_p:g}; {self.chat_share:.0%} of the sequences open with the chat template's user turn "
            "instead, where the tokenizer has one"
        )

    def record(self) -> dict:
        return asdict(self)


DEFAULT_RECIPE = SamplingRecipe()  # read at each call (recipe=None), so a bench may swap it
# convert's batches (batch_for): up to MOST_SEQUENCES at once while their float32 KV cache fits BATCH_CACHE_BYTES
MOST_SEQUENCES = 64
BATCH_CACHE_BYTES = 2 << 30
NUCLEUS_CANDIDATES = 1024  # tokens the top-p nucleus is looked for among first (nucleus_draw)


def flops(params: int, tokens: int) -> float:
    """About 2 FLOPs a parameter a token: one forward per sampled token (the cache saves the rest)."""
    return 2.0 * params * tokens


def forward_work(
    tokens: int, seq_len: int, chat: bool, recipe: SamplingRecipe | None = None, batch: int | None = None
) -> tuple[int, int]:
    """(batched forwards, tokens drawn) of sample_ids for `tokens`, as the estimates cost it: every batch of up to
    `batch` (default recipe.batch) sequences takes seq_len forwards, and the random starts and the chat turns
    (`chat`: the tokenizer has a template) are batched apart. A forward's cost hardly grows with its batch on a CPU
    (one SmolLM2 step: 44 ms, each sequence in it 6 ms more), so the forwards, not the tokens, set the time of a
    small batch."""
    recipe = recipe or DEFAULT_RECIPE
    batch = batch or recipe.batch
    sequences = -(-tokens // seq_len)
    chats = round(sequences * recipe.chat_share) if chat else 0
    batches = -(-(sequences - chats) // batch) + -(-chats // batch)
    return batches * seq_len, sequences * seq_len


def batch_for(config: dict, seq_len: int, recipe: SamplingRecipe | None = None) -> int:
    """Sequences convert draws at once: recipe.batch, or more, up to MOST_SEQUENCES, while their float32 KV cache
    stays within BATCH_CACHE_BYTES. Why: a CPU forward's fixed part (44 ms of SmolLM2's, beside 6 ms a sequence)
    is paid once a batch, so SmolLM2's default 36 sequences of each kind (23.6 MB of cache each) go in one batch
    instead of 16 + 16 + 4; a 7B model's (268 MB each) stay at 16."""
    from mha2gqa.architecture.layouts import attention_shape

    recipe = recipe or DEFAULT_RECIPE
    per_sequence = _kv_bytes(attention_shape(config), seq_len, 1)
    return max(recipe.batch, min(MOST_SEQUENCES, BATCH_CACHE_BYTES // max(1, per_sequence)))


def _kv_bytes(shape, seq_len: int, batch: int) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * seq_len * batch * 4


def has_chat_template(folder) -> bool:
    """Whether a model folder's tokenizer has a chat template (its own file, or tokenizer_config.json's key),
    read without loading the tokenizer: what chat_turn_header finds when the template renders a user turn."""
    from pathlib import Path

    from mha2gqa.files.reading import read_json
    from mha2gqa.runtime.errors import InputError

    folder = Path(folder)
    if any((folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:  # bounded, as every JSON file of a model the user hands us; an unreadable one only costs the estimate
        config = read_json(folder / "tokenizer_config.json", fix="")
    except (InputError, OSError):
        return False
    return bool(isinstance(config, dict) and config.get("chat_template"))


def cache_bytes(config: dict, shape, seq_len: int, batch: int) -> int:
    """Memory beyond the model while sampling `batch` sequences at once, float32: their KV cache at full length and
    a few vocabulary-wide rows per sequence."""
    from mha2gqa.architecture.layouts import config_vocab

    return _kv_bytes(shape, seq_len, batch) + 4 * batch * config_vocab(config) * 4


def first_token_pool(tokenizer, vocab_size: int):
    """The ids a sequence may start from: every id of the model's vocabulary that the tokenizer knows
    and that is no special token (BOS/EOS/pad/chat markers would start or end a document)."""
    import torch

    special = set(tokenizer.all_special_ids)
    known = min(vocab_size, len(tokenizer))
    return torch.tensor([i for i in range(known) if i not in special], dtype=torch.long)


def chat_turn_header(tokenizer, seq_len: int):
    """The ids (P,) that open a user's turn in the tokenizer's chat template (a default system prompt
    included, as the model was tuned with), or None: no template, one that cannot render a lone user
    message, or a header longer than a quarter of the sequence."""
    import torch

    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\u2063MHA2GQA-REQUEST\u2063"  # a string no template writes by itself
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    except Exception:  # jinja's TemplateError, a template that raises on its own rules: no chat turns
        return None
    if not isinstance(text, str) or marker not in text:
        return None
    ids = tokenizer(text.split(marker)[0], add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long) if 0 < len(ids) <= seq_len // 4 else None


def sampling_record(
    model, tokenizer, seq_len: int, seed: int, recipe: SamplingRecipe | None = None, batch: int | None = None
) -> dict:
    """What a record says of samples drawn by sample_ids: the recipe (its batch the one used), the chat header as
    text (or None), the seed and the device that drew them (convert's calibration and uptrain's data record the
    same)."""
    recipe = recipe or DEFAULT_RECIPE
    header = chat_turn_header(tokenizer, seq_len) if recipe.chat_share > 0 else None
    return {
        **recipe.record(),
        "batch": batch or recipe.batch,
        "chat_turn_header": None if header is None else tokenizer.decode(header),
        "seed": seed,
        "device": str(next(model.parameters()).device),
    }


def sample_ids(
    model,
    tokenizer,
    tokens: int,
    seq_len: int,
    seed: int,
    recipe: SamplingRecipe | None = None,
    progress=True,
    batch: int | None = None,
):
    """`tokens` ids (N,) sampled from `model` (a loaded causal LM), in sequences of `seq_len`, up to `batch`
    (default recipe.batch) at once: random starts first, then chat turns, all from one generator, their sequences
    interleaved in proportion. The batch changes which ids a seed draws, not how they are drawn."""
    recipe = recipe or DEFAULT_RECIPE
    batch_size = batch or recipe.batch
    import torch
    from tqdm.auto import tqdm

    from mha2gqa.corpus.blocks import MixOrder, mix_blocks

    generator = torch.Generator().manual_seed(seed)
    pool = first_token_pool(tokenizer, model.config.vocab_size)
    header = chat_turn_header(tokenizer, seq_len) if recipe.chat_share > 0 else None
    sequences = -(-tokens // seq_len)
    chat = 0 if header is None else round(sequences * recipe.chat_share)
    device = next(model.parameters()).device
    random_starts, chat_turns = [], []
    with tqdm(total=sequences * seq_len, desc="sample", unit="tok", unit_scale=True, disable=not progress) as bar:
        for start in range(0, sequences - chat, batch_size):
            count = min(batch_size, sequences - chat - start)
            first = pool[torch.randint(len(pool), (count, 1), generator=generator)]
            random_starts.append(
                sample_batch(model, first, seq_len, recipe.greedy_tokens, recipe, generator, device, bar)
            )
        for start in range(0, chat, batch_size):
            opening = header.expand(min(batch_size, chat - start), -1)
            chat_turns.append(sample_batch(model, opening, seq_len, 0, recipe, generator, device, bar))
    rows = [torch.cat(kind) for kind in (random_starts, chat_turns) if kind]  # (n, seq_len) of each kind
    return mix_blocks(rows, MixOrder.SPREAD).reshape(-1)[:tokens]


def sample_batch(model, opening, seq_len: int, greedy: int, recipe: SamplingRecipe, generator, device, bar):
    """(B, P) opening ids -> (B, seq_len) sequences, one forward a token through the KV cache; the first
    `greedy` tokens after the opening are the likeliest, the rest drawn."""
    import torch

    from mha2gqa.architecture.hfcache import cache_kwargs, cache_of

    ids = [opening]
    cache, step_input = None, opening.to(device)
    bar.update(opening.numel())
    with torch.no_grad():
        for position in range(opening.shape[1], seq_len):
            output = model(step_input, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
            cache = cache_of(output)
            logits = output.logits[:, -1].float()  # (B, V), on the model's device
            greedy_here = position < opening.shape[1] + greedy
            chosen = logits.argmax(-1).cpu() if greedy_here else nucleus_draw(logits, recipe, generator)
            ids.append(chosen[:, None])
            step_input = chosen[:, None].to(device)
            bar.update(len(chosen))
    return torch.cat(ids, dim=1)


def nucleus_draw(logits, recipe: SamplingRecipe, generator):
    """One token per row from softmax(logits / T), restricted to the top-p nucleus. The nucleus is looked
    for among the NUCLEUS_CANDIDATES likeliest tokens (a top-k, far cheaper than sorting the vocabulary);
    only the rows whose nucleus is wider than that (a flat distribution) are sorted in full: sorting and
    drawing over the whole vocabulary for every row of a batch that holds one such row was half the cost
    of a sampled token on SmolLM2 (docs/calibration.md). The narrow rows draw first, then the wide ones.

    Everything runs where the logits are (a GPU, when the model is there) except the narrow rows' draw: their
    candidates come to the CPU, where `generator` (a CPU generator) draws them. A wide row's nucleus spans up
    to the whole vocabulary, too much to move and draw on the CPU each step (on one H200, SmolLM2 sampled about
    1,400 tokens/s at batch 256 that way: gpu_check part 6, 2026-12-04), so on an accelerator it is drawn there by a
    generator seeded from `generator`: the same draws on each run, a device's own. On the CPU nothing
    changes. Returns the chosen ids on the CPU."""
    import torch

    probs = torch.softmax(logits.float() / recipe.temperature, dim=-1)  # (B, V) float32
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    ordered, order = probs.topk(k, dim=-1)  # descending
    # The wide-row mask on the logits' device indexes probs and ordered; its CPU copy indexes `chosen`.
    wide_there = ordered.sum(-1) < recipe.top_p
    wide = wide_there.cpu()
    narrow = ~wide
    chosen = torch.empty(len(probs), dtype=torch.long)
    if bool(narrow.any()):
        rows = ~wide_there
        chosen[narrow] = nucleus_pick(ordered[rows].cpu(), order[rows].cpu(), recipe.top_p, generator)
    if bool(wide.any()):
        ranked, ids = probs[wide_there].sort(dim=-1, descending=True)
        chosen[wide] = nucleus_pick(ranked, ids, recipe.top_p, device_generator(generator, probs.device)).cpu()
    return chosen


def device_generator(generator, device):
    """`generator` itself on the CPU; elsewhere a generator on `device` seeded by one draw of `generator`."""
    import torch

    if device.type == "cpu":
        return generator
    seed = int(torch.randint(2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


def nucleus_pick(ordered, order, top_p: float, generator):
    """One of each row's candidates (`ordered` probabilities, descending, of the ids `order`), drawn from
    the smallest prefix holding `top_p` of the probability."""
    import torch

    ordered = ordered.clone()
    ordered[ordered.cumsum(-1) - ordered > top_p] = 0.0  # tokens after the nucleus is full
    picked = torch.multinomial(ordered, 1, generator=generator)
    return order.gather(1, picked).squeeze(1)
