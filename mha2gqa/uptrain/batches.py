"""Training batches as a pure function of (seed, micro-step, rank).

A resumed run asks for the batches from its micro-step on and gets exactly what the uninterrupted run
saw; the ranks take disjoint slices of every global batch (in memory) or disjoint documents (streaming).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch

from mha2gqa.errors import InputError
from mha2gqa.textdata import dataset_texts
from mha2gqa.uptrain.data import pack, token_docs


class MemoryBatches:
    """In-memory blocks, reshuffled exactly every epoch from the seed."""

    def __init__(self, blocks: torch.Tensor, micro_batch: int, rank: int, world_size: int, seed: int):
        self.blocks, self.mb, self.rank, self.ws, self.seed = blocks, micro_batch, rank, world_size, seed
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

    def batch(self, micro_step: int) -> torch.Tensor:
        """(micro_batch, seq_len) int64 for this rank at global micro-step `micro_step`."""
        epoch, index = divmod(micro_step, self.per_epoch)
        lo = (index * self.ws + self.rank) * self.mb
        return self.blocks[self._permutation(epoch)[lo: lo + self.mb]].long()

    def batches(self, start: int) -> Iterator[torch.Tensor]:
        for micro_step in itertools.count(start):
            yield self.batch(micro_step)


class StreamBatches:
    """Documents streamed through a seeded shuffle buffer, split between ranks by document."""

    def __init__(self, ds, field: str, tokenizer, eos_id: int, seq_len: int, micro_batch: int,
                 rank: int, world_size: int, seed: int, buffer: int):
        self.ds, self.field, self.tokenizer, self.eos_id, self.seq_len = ds, field, tokenizer, eos_id, seq_len
        self.mb, self.rank, self.ws, self.seed, self.buffer = micro_batch, rank, world_size, seed, buffer

    def _rows(self, epoch: int) -> Iterator[np.ndarray]:
        from datasets.distributed import split_dataset_by_node

        # Shuffle first with the same seed on every rank, then split: the ranks see disjoint documents.
        ds = self.ds.shuffle(seed=self.seed, buffer_size=self.buffer)
        ds.set_epoch(epoch)
        ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.ws)
        texts = dataset_texts(ds, self.field, "data.train", "data.text_field")
        for chunk in pack(token_docs(texts, self.tokenizer), self.eos_id, self.seq_len):
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
