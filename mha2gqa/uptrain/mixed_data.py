"""A recipe's data when data.train is more than one text: the teacher's own samples (`parent`), or parts
with shares (`[parent:0.5, corpus.txt:0.5]`, data_spec.py). The one entry point of the loop's data.

Distillation without data: text sampled from the MHA parent is drawn from the distribution the student
is fitted to, so it needs no corpus of the user's (LLM-QAT, 2023, for the sampling recipe). Each process
draws its own sequences, `seq_len` long, with the seed recipe.seed + its process index (so the ranks
train on different samples and a rerun draws the same ones), up front and exactly as many as the loop
consumes: total_steps x grad_accum x micro_batch_size blocks a process. A mix gives every part its share
of those blocks: the text's blocks a seeded choice of all it packs into (repeated when it holds fewer),
each process taking every world_size-th. Unless data.eval is set, eval blocks are held out in the same
shares, the parent's drawn with a seed of their own (recipe.seed + EVAL_SEED_OFFSET, the same on every
process). What was drawn (recipe, seeds, the ids' sha256 per process) goes into the run's record.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch

from mha2gqa.corpus import sampling
from mha2gqa.corpus.blocks import MixOrder, mix_blocks
from mha2gqa.corpus.mix import part_tokens
from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain import copy_task, sample_cache
from mha2gqa.uptrain.data import (
    MemoryBatches,
    TrainData,
    build_data,
    eval_text_blocks,
    hold_out,
    rank_slice,
    sources,
    text_blocks,
)
from mha2gqa.uptrain.data_spec import DataPart, is_plain
from mha2gqa.uptrain.plan import total_steps
from mha2gqa.uptrain.recipe import Recipe

EVAL_SEED_OFFSET = 1 << 32  # eval samples' seed - recipe.seed: apart from every process's training seed


def local_blocks(recipe: Recipe, world_size: int) -> int:
    """Training blocks one process consumes over the whole budget."""
    return total_steps(recipe, world_size) * recipe.grad_accum * recipe.micro_batch_size


def build(
    recipe: Recipe, tokenizer, rank: int, world_size: int, show_progress: bool, teacher=None, first=None
) -> TrainData:
    """The run's data. `first` (accelerator.main_process_first) wraps the reading of text, so that rank 0
    fills the datasets cache before the others read it; the sampling runs on every process at once."""
    first = first or contextlib.nullcontext
    parts, eval_src = sources(recipe.data)
    if is_plain(parts):
        with first():
            return build_data(recipe, tokenizer, rank, world_size, show_progress)
    cfg, seq_len = recipe.data, recipe.seq_len
    shares = [part.share for part in parts]
    counts = [t // seq_len for t in part_tokens(shares, local_blocks(recipe, world_size) * seq_len, seq_len)]
    held = None if eval_src else [t // seq_len for t in part_tokens(shares, cfg.eval_blocks * seq_len, seq_len)]
    with first():
        evals = [eval_text_blocks(eval_src, cfg, tokenizer, seq_len)] if eval_src else []
        texts = [None if p.text is None else text_blocks(p.text, cfg, tokenizer, seq_len, show_progress) for p in parts]
    pool, rows, evals_of, eval_record = [], [], [], {"data": cfg.eval or "held out of data.train", "blocks": 0}
    for i, part in enumerate(parts):
        held_n = held[i] if held else 0
        if part.copies:  # made of the other parts, once they are drawn
            train, row, held_blocks = (None, None, held_n)
        elif part.sampled:
            train, row, held_blocks = _sampled_part(
                part, teacher, tokenizer, recipe, (counts[i], held_n), rank, world_size, show_progress
            )
            if held_n:
                eval_record |= {"parent_blocks": held_n, "parent_seed": row.pop("eval_seed")}
                eval_record["parent_ids_sha256"] = row.pop("eval_ids_sha256")
        else:
            _enough(part, texts[i], held_n, cfg.eval_blocks)
            train, row, held_blocks = _text_part(part, texts[i], recipe.seed, counts[i], held_n, rank, world_size)
        pool.append(train)
        rows.append(row)
        evals_of.append(held_blocks)
    marks = _copy_parts(parts, pool, rows, evals_of, tokenizer, recipe, (counts, rank, world_size))
    evals += evals_of
    eval_blocks = torch.cat([e for e in evals if len(e)])
    eval_record["blocks"] = len(eval_blocks)
    blocks = mix_blocks(pool, MixOrder.IN_TURN)  # the batches shuffle it; marks follow the same order
    train = MemoryBatches(blocks, recipe.micro_batch_size, 0, 1, recipe.seed, marks)  # this process's own pool
    record = {"train": list(cfg.train), "seq_len": seq_len, "parts": rows, "eval": eval_record}
    if teacher is not None and any(p.sampled for p in parts):
        record["sampling"] = sampling.sampling_record(teacher, tokenizer, seq_len, recipe.seed)
    return TrainData(train, eval_blocks, len(blocks), record)


def _copy_parts(parts, pool: list, rows: list, evals: list, tokenizer, recipe: Recipe, where) -> torch.Tensor | None:
    """Fill in the `retrieval` part (copy_task.py) from the other parts' blocks: its training blocks with the seed
    recipe.seed + rank, its held-out ones (when eval blocks are held out) with the eval seed, from the others'
    held-out blocks. Returns the answer marks of the whole pool (None without a retrieval part)."""
    counts, rank, world = where
    at = next((i for i, part in enumerate(parts) if part.copies), None)
    if at is None:
        return None
    others = [blocks for i, blocks in enumerate(pool) if i != at]
    haystack = torch.cat(others)
    ids, answer = copy_task.retrieval_blocks(haystack, tokenizer, counts[at], recipe.seq_len, recipe.seed + rank)
    pool[at] = ids
    rows[at] = {"name": parts[at].name, "share": parts[at].share, "blocks": counts[at] * world}
    rows[at] |= {"tokens": counts[at] * world * recipe.seq_len, "seeds": [recipe.seed + rank]}
    rows[at] |= {"answer_tokens": int(answer.sum()) * world, "ids_sha256": [ids_sha256(ids)]}
    held = evals[at]
    evals[at] = torch.zeros(0, recipe.seq_len, dtype=torch.int32)
    if held:
        held_hay = torch.cat([e for i, e in enumerate(evals) if i != at and len(e)] or [haystack])
        seed = recipe.seed + EVAL_SEED_OFFSET
        evals[at] = copy_task.retrieval_blocks(held_hay, tokenizer, held, recipe.seq_len, seed)[0]
    return torch.cat([answer if i == at else torch.zeros(b.shape, dtype=torch.bool) for i, b in enumerate(pool)])


def _sampled_part(part: DataPart, teacher, tokenizer, recipe: Recipe, counts, rank: int, world: int, progress: bool):
    """This process's sampled training blocks (counts[0], seed recipe.seed + rank) and the eval blocks
    (counts[1], the eval seed: the same on every process), with what to record of them."""
    (count, held), seq_len = counts, recipe.seq_len
    train = _kept_or_drawn(recipe, teacher, tokenizer, count, recipe.seed + rank, progress)
    row = {"name": part.name, "share": part.share, "blocks": count * world, "tokens": count * world * seq_len}
    row |= {"seeds": [recipe.seed + rank], "ids_sha256": [ids_sha256(train)]}
    held_blocks = torch.zeros(0, seq_len, dtype=torch.int32)
    if held:
        held_blocks = _kept_or_drawn(recipe, teacher, tokenizer, held, recipe.seed + EVAL_SEED_OFFSET, progress)
        row |= {"eval_seed": recipe.seed + EVAL_SEED_OFFSET, "eval_ids_sha256": ids_sha256(held_blocks)}
    return train, row, held_blocks


def _kept_or_drawn(recipe: Recipe, teacher, tokenizer, count: int, seed: int, progress: bool) -> torch.Tensor:
    """`count` sampled blocks of seed `seed`: the cache's when this draw was made before (sample_cache.py)."""
    seq_len = recipe.seq_len
    blocks, cached = sample_cache.cached_blocks(
        recipe.distill.teacher,
        teacher,
        tokenizer,
        count,
        seq_len,
        seed,
        lambda: sample_blocks(teacher, tokenizer, count, seq_len, seed, progress),
    )
    if cached and progress:
        print(f"data.train parent: {count} blocks of seed {seed} read from the cache, not sampled again", flush=True)
    return blocks


def _text_part(part: DataPart, blocks: torch.Tensor, seed: int, count: int, held: int, rank: int, world: int):
    """This process's `count` blocks of one text (every world-th of a seeded choice of count x world blocks,
    after `held` blocks are held out for eval), with what to record of them."""
    held_blocks = torch.zeros(0, blocks.shape[1], dtype=torch.int32)
    if held:
        blocks, held_blocks = hold_out(blocks, held, seed)
    chosen = take(blocks, count * world, seed)
    row = {"name": part.name, "share": part.share, "blocks": count * world, "tokens": chosen.numel()}
    row |= {"files": [str(f) for f in part.text.files] or [part.text.hub], "text_blocks": len(blocks)}
    row["repeated"] = len(blocks) < count * world
    return rank_slice(chosen, rank, world), row, held_blocks


def _enough(part: DataPart, blocks: torch.Tensor, held: int, eval_blocks: int) -> None:
    """A text part must pack into more blocks than it holds out (a shorter one repeats in training, but not
    into nothing)."""
    if len(blocks) <= held or not len(blocks):
        share = f" (its share of data.eval_blocks={eval_blocks})" if held else ""
        raise InputError(
            f"data.train {part.name} packs into {len(blocks)} blocks of seq_len tokens, not more than the {held} "
            f"held out for eval{share}: add text, lower seq_len or data.eval_blocks, or give data.eval"
        )


def take(blocks: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """`count` of `blocks` in a seeded order: each block once before any twice (a short text repeats)."""
    generator = torch.Generator().manual_seed(seed)
    passes = -(-count // len(blocks))
    order = torch.cat([torch.randperm(len(blocks), generator=generator) for _ in range(passes)])
    return blocks[order[:count]]


def sample_blocks(teacher, tokenizer, count: int, seq_len: int, seed: int, progress: bool = True) -> torch.Tensor:
    """(count, seq_len) int32 blocks sampled from `teacher` (convert's recipe, sampling.sample_ids)."""
    if teacher is None:  # data_spec.validate_rules refuses the recipe; a Recipe built in code may skip it
        raise ValueError("data.train parent needs the teacher: set distill.teacher")
    ids = sampling.sample_ids(teacher, tokenizer, count * seq_len, seq_len, seed, progress=progress)
    return ids.reshape(count, seq_len).to(torch.int32)


def ids_sha256(blocks: torch.Tensor) -> str:
    """sha256 of the ids as int64, row after row (convert's calibration record hashes the same bytes)."""
    return hashlib.sha256(blocks.to(torch.int64).reshape(-1).numpy().tobytes()).hexdigest()


def merge_records(records: list[dict]) -> dict:
    """The record of every process (in rank order) as one: each sampled part's seeds and sha256 per process."""
    merged = records[0]
    for i, row in enumerate(merged["parts"]):
        if "ids_sha256" in row:
            row["seeds"] = [seed for r in records for seed in r["parts"][i]["seeds"]]
            row["ids_sha256"] = [sha for r in records for sha in r["parts"][i]["ids_sha256"]]
    return merged


def describe(record: dict) -> str:
    """One line for the start of a run: what it trains and evaluates on."""
    parts = []
    for row in record["parts"]:
        what = f"of {row['name']}"
        if "seeds" in row:
            what = "of retrieval prompts" if "answer_tokens" in row else "sampled from distill.teacher"
        again = " (repeated: the text holds fewer)" if row.get("repeated") else ""
        parts.append(f"{row['blocks']} blocks {what}{again}")
    evals = record["eval"]
    held = (
        f", {evals['parent_blocks']} of them sampled with seed {evals['parent_seed']}" if "parent_seed" in evals else ""
    )
    return (
        f"data.train: {'; '.join(parts)} ({record['seq_len']} tokens each; samples seeded with seed + process "
        f"index); eval: {evals['blocks']} blocks {_eval_words(evals['data'])}{held}"
    )


def _eval_words(data) -> str:
    return data if isinstance(data, str) else f"of {', '.join(data)}"
