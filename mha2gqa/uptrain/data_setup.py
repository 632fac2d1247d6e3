"""A recipe's data, ready for the loop: per-rank training batches and the held-out eval blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from mha2gqa import textdata
from mha2gqa.errors import InputError
from mha2gqa.uptrain.batches import MemoryBatches, StreamBatches
from mha2gqa.uptrain.data import pack_all, token_docs
from mha2gqa.uptrain.recipe import Recipe


@dataclass
class TrainData:
    train: MemoryBatches | StreamBatches
    eval: torch.Tensor
    """(n_eval, seq_len) int32 held-out blocks, the same on every rank."""
    train_blocks: int | None
    """Training blocks in memory (None when streaming: unknown until read)."""


def build_data(recipe: Recipe, tokenizer, rank: int, world_size: int, show_progress: bool) -> TrainData:
    cfg, seq_len = recipe.data, recipe.seq_len
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise InputError("the tokenizer has no eos_token: packing needs one between documents (set tokenizer=...)")
    problems: list[str] = []
    train_src = textdata.resolve("data.train", cfg.train, problems, one_format=True)
    eval_src = textdata.resolve("data.eval", cfg.eval, problems, one_format=True) if cfg.eval is not None else None
    if problems:
        raise InputError("; ".join(problems))

    def tokenized(source, streaming):
        ds = textdata.load_documents(source, cfg.text_field, field_key="data.text_field", streaming=streaming,
                                     sample_by=cfg.sample_by, hub_config=cfg.name, hub_split=cfg.split)
        total = None if streaming else len(ds)
        bar = tqdm(textdata.dataset_texts(ds, cfg.text_field, source.key, "data.text_field"), total=total, desc="tokenizing", unit="doc", disable=streaming or not show_progress)
        return ds, token_docs(bar, tokenizer)

    eval_blocks = None
    if eval_src is not None:
        eval_blocks = pack_all(tokenized(eval_src, True)[1], eos_id, seq_len, limit=cfg.eval_blocks)
        _need_blocks(eval_blocks, "data.eval")
    if cfg.streaming:
        ds, docs = tokenized(train_src, True)
        if eval_blocks is None:
            # Hold out the stream's first documents: enough of them to fill eval_blocks blocks.
            used = [0]
            eval_blocks = pack_all(_counting(docs, used), eos_id, seq_len, limit=cfg.eval_blocks)
            _need_blocks(eval_blocks, "data.train (for the held-out eval blocks)")
            ds = ds.skip(used[0])
        train = StreamBatches(ds, cfg.text_field, tokenizer, eos_id, seq_len, recipe.micro_batch_size,
                              rank, world_size, recipe.seed, cfg.shuffle_buffer)
        return TrainData(train, eval_blocks, None)
    blocks = pack_all(tokenized(train_src, False)[1], eos_id, seq_len)
    if eval_blocks is None:
        blocks, eval_blocks = _hold_out(blocks, cfg.eval_blocks, recipe.seed)
    train = MemoryBatches(blocks, recipe.micro_batch_size, rank, world_size, recipe.seed)
    return TrainData(train, eval_blocks, len(blocks))


def _counting(docs, used: list[int]):
    for ids in docs:
        used[0] += 1
        yield ids


def _need_blocks(blocks: torch.Tensor, key: str) -> None:
    if len(blocks) == 0:
        raise InputError(f"{key} holds fewer tokens than one block of seq_len: add text or lower seq_len")


def _hold_out(blocks: torch.Tensor, n_eval: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random set of n_eval blocks for eval; the rest (in corpus order) for training."""
    if len(blocks) <= n_eval:
        raise InputError(
            f"data.train packs into {len(blocks)} blocks, not more than data.eval_blocks={n_eval}: "
            "add data, lower seq_len or data.eval_blocks, or give data.eval"
        )
    perm = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    held = torch.zeros(len(blocks), dtype=torch.bool)
    held[perm[:n_eval]] = True
    return blocks[~held], blocks[held]
