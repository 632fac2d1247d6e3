"""A recipe's data, ready for the loop: text -> tokens -> packed seq_len blocks (EOS between
documents, no padding: corpus/tokens.py and corpus/blocks.py) -> per-rank training batches and the held-out
eval blocks.

Documents come from mha2gqa.corpus.textdata (a `datasets` Dataset of local files or a hub dataset). Training
batches are a pure function of (seed, micro-step, rank): a resumed run asks for the batches from its
micro-step on and gets exactly what the uninterrupted run saw; the ranks take disjoint slices of
every global batch (in memory) or disjoint documents (streaming).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from mha2gqa.corpus import textdata
from mha2gqa.corpus.blocks import pack, pack_all
from mha2gqa.corpus.tokens import document_ids
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.progress import progress_bar
from mha2gqa.uptrain.data_spec import DataPart, data_parts, is_plain
from mha2gqa.uptrain.recipe import DataConfig, Recipe

# ---- blocks ----


def block_hash(block: torch.Tensor) -> str:
    """Short content hash of one block (for the data-order audit trace)."""
    return hashlib.blake2b(block.to(torch.int32).numpy().tobytes(), digest_size=8).hexdigest()


def rank_slice(blocks: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Every world_size-th block from `rank`, the same count on each rank (collective forwards need it)."""
    usable = len(blocks) // world_size * world_size
    return blocks[rank:usable:world_size]


# ---- training batches ----


class MemoryBatches:
    """In-memory blocks, reshuffled exactly every epoch from the seed. With `marks` ((n, seq_len) bool: the
    answer tokens of data.train retrieval, copy_task.py), each batch comes as (ids, marks), the same rows."""

    def __init__(
        self,
        blocks: torch.Tensor,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        marks: torch.Tensor | None = None,
    ):
        self.blocks, self.mb, self.rank, self.ws, self.seed = blocks, micro_batch, rank, world_size, seed
        self.marks = marks
        # Global micro-batches per epoch; the tail that cannot give every rank a full batch waits a epoch.
        self.per_epoch = len(blocks) // (micro_batch * world_size)
        if self.per_epoch == 0:
            raise InputError(
                f"the training data holds {len(blocks)} blocks of seq_len tokens, fewer than one batch "
                f"(micro_batch_size x processes = {micro_batch * world_size}): add data or lower seq_len/micro_batch_size"
            )
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 1)
            self._epoch, self._perm = epoch, torch.randperm(len(self.blocks), generator=gen)
        return self._perm

    def _rows(self, micro_step: int) -> torch.Tensor:
        epoch, index = divmod(micro_step, self.per_epoch)
        lo = (index * self.ws + self.rank) * self.mb
        return self._permutation(epoch)[lo : lo + self.mb]

    def batch(self, micro_step: int) -> torch.Tensor:
        """(micro_batch, seq_len) int64 for this rank at global micro-step `micro_step`."""
        return self.blocks[self._rows(micro_step)].long()

    def batches(self, start: int) -> Iterator:
        """The batches from micro-step `start` on: ids, or (ids, answer marks) with marks."""
        for micro_step in itertools.count(start):
            rows = self._rows(micro_step)
            ids = self.blocks[rows].long()
            yield ids if self.marks is None else (ids, self.marks[rows])


class StreamBatches:
    """Documents streamed through a seeded shuffle buffer, split between ranks by document."""

    def __init__(
        self,
        ds,
        field: str,
        tokenizer,
        eos_id: int,
        seq_len: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        buffer: int,
    ):
        self.ds, self.field, self.tokenizer, self.eos_id, self.seq_len = ds, field, tokenizer, eos_id, seq_len
        self.mb, self.rank, self.ws, self.seed, self.buffer = micro_batch, rank, world_size, seed, buffer

    def _rows(self, epoch: int) -> Iterator[np.ndarray]:
        from datasets.distributed import split_dataset_by_node

        # Shuffle first with the same seed on every rank, then split: the ranks see disjoint documents.
        ds = self.ds.shuffle(seed=self.seed, buffer_size=self.buffer)
        ds.set_epoch(epoch)
        ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.ws)
        texts = textdata.dataset_texts(ds, self.field, "data.train", "data.text_field")
        for chunk in pack(document_ids(texts, self.tokenizer), self.eos_id, self.seq_len):
            yield from chunk

    def batches(self, start: int) -> Iterator[torch.Tensor]:
        """(micro_batch, seq_len) int64 batches from micro-step `start` on; resuming re-reads the skipped
        part of the stream (exact, but it costs time proportional to the progress)."""
        produced = 0
        for epoch in itertools.count():
            full = 0
            rows = self._rows(epoch)
            while len(batch := list(itertools.islice(rows, self.mb))) == self.mb:
                full += 1
                if produced >= start:
                    yield torch.from_numpy(np.stack(batch)).long()
                produced += 1
            if full == 0:
                raise InputError(
                    f"rank {self.rank} got no full batch of {self.mb} blocks from the stream: "
                    "add data or lower seq_len/micro_batch_size"
                )


# ---- a recipe's data ----


@dataclass
class TrainData:
    train: MemoryBatches | StreamBatches
    eval: torch.Tensor
    """(n_eval, seq_len) int32 held-out blocks, the same on every rank."""
    train_blocks: int | None
    """Training blocks in memory (None when streaming: unknown until read)."""
    record: dict | None = None
    """What the data was, for the run's record, when data.train is a mix or the teacher's samples
    (mixed_data.py); None for one text (the recipe names it)."""


def build_data(recipe: Recipe, tokenizer, rank: int, world_size: int, show_progress: bool) -> TrainData:
    """The data of a recipe whose data.train is one text (data_spec.is_plain; mixed_data.py reads mixes and
    the teacher's samples)."""
    cfg, seq_len = recipe.data, recipe.seq_len
    eos_id = eos_of(tokenizer)
    train_parts, eval_src = sources(cfg)
    if not is_plain(train_parts):
        raise ValueError("build_data reads one text: mixed_data.build reads mixes and the teacher's samples")
    train_src = train_parts[0].text
    eval_blocks = None if eval_src is None else eval_text_blocks(eval_src, cfg, tokenizer, seq_len)
    if cfg.streaming:
        ds, docs = tokenized(train_src, cfg, tokenizer, True, show_progress)
        if eval_blocks is None:
            # Hold out the stream's first documents: enough of them to fill eval_blocks blocks.
            used = [0]
            eval_blocks = pack_all(_counting(docs, used), eos_id, seq_len, limit=cfg.eval_blocks)
            _need_blocks(eval_blocks, "data.train (for the held-out eval blocks)")
            ds = ds.skip(used[0])
        train = StreamBatches(
            ds,
            cfg.text_field,
            tokenizer,
            eos_id,
            seq_len,
            recipe.micro_batch_size,
            rank,
            world_size,
            recipe.seed,
            cfg.shuffle_buffer,
        )
        return TrainData(train, eval_blocks, None)
    blocks = text_blocks(train_src, cfg, tokenizer, seq_len, show_progress)
    if eval_blocks is None:
        blocks, eval_blocks = hold_out(blocks, cfg.eval_blocks, recipe.seed)
    train = MemoryBatches(blocks, recipe.micro_batch_size, rank, world_size, recipe.seed)
    return TrainData(train, eval_blocks, len(blocks))


def eos_of(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise InputError("the tokenizer has no eos_token: packing needs one between documents (set tokenizer=...)")
    return tokenizer.eos_token_id


def tokenized(source: textdata.TextSource, cfg: DataConfig, tokenizer, streaming: bool, show_progress: bool):
    """(dataset, token ids per document) of one text."""
    ds = textdata.load_documents(
        source,
        cfg.text_field,
        field_key="data.text_field",
        streaming=streaming,
        sample_by=cfg.sample_by,
        hub_config=cfg.name,
        hub_split=cfg.split,
    )
    total = None if streaming else len(ds)
    texts = textdata.dataset_texts(ds, cfg.text_field, source.key, "data.text_field")
    bar = progress_bar(total, "tokenizing", not streaming and show_progress, texts, unit="doc")
    return ds, document_ids(bar, tokenizer)


def text_blocks(source: textdata.TextSource, cfg: DataConfig, tokenizer, seq_len: int, show_progress: bool):
    """Every packed block of one text, (n, seq_len) int32."""
    return pack_all(tokenized(source, cfg, tokenizer, False, show_progress)[1], eos_of(tokenizer), seq_len)


def eval_text_blocks(source: textdata.TextSource, cfg: DataConfig, tokenizer, seq_len: int) -> torch.Tensor:
    """The first data.eval_blocks blocks of data.eval."""
    docs = tokenized(source, cfg, tokenizer, True, False)[1]
    blocks = pack_all(docs, eos_of(tokenizer), seq_len, limit=cfg.eval_blocks)
    _need_blocks(blocks, "data.eval")
    return blocks


def sources(cfg: DataConfig) -> tuple[tuple[DataPart, ...], textdata.TextSource | None]:
    """data.train's parts and data.eval's text: those load_recipe found while it checked the files,
    or, for a recipe loaded with validate_files=False, built in code or changed since, found (and
    checked) now."""
    checked, problems, found = getattr(cfg, "checked_sources", {}), [], []
    for key, entries in (("data.train", cfg.train), ("data.eval", cfg.eval)):
        if entries is None:
            found.append(None)
        elif key in checked and checked[key][0] == list(entries):
            found.append(checked[key][1])
        else:
            found.append(data_parts(key, entries, problems, field=cfg.text_field))
    if problems:
        raise InputError("; ".join(problems))
    evals = found[1]
    if evals is not None and not is_plain(evals):
        raise InputError(f"data.eval {', '.join(cfg.eval)}: eval data is one text without shares (leave it unset)")
    return found[0], None if evals is None else evals[0].text


def _counting(docs, used: list[int]):
    for ids in docs:
        used[0] += 1
        yield ids


def _need_blocks(blocks: torch.Tensor, key: str) -> None:
    if len(blocks) == 0:
        raise InputError(f"{key} holds fewer tokens than one block of seq_len: add text or lower seq_len")


def hold_out(blocks: torch.Tensor, n_eval: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
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
