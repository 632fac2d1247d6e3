"""Text -> tokens -> packed seq_len blocks, with EOS between documents and no padding.

Documents come from mha2gqa.textdata (a `datasets` Dataset of local files or a hub dataset); batches.py
turns the blocks into per-rank training batches and data_setup.py puts the pieces together for a recipe.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import torch


def token_docs(texts: Iterable[str], tokenizer, batch: int = 64) -> Iterator[list[int]]:
    """Token ids per document, without BOS/EOS (packing adds the separators)."""
    it = iter(texts)
    while chunk := list(itertools.islice(it, batch)):
        # verbose=False: whole documents exceed model_max_length by design (packing cuts them)
        yield from tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]


def pack(docs: Iterable[list[int]], eos_id: int, seq_len: int) -> Iterator[np.ndarray]:
    """Concatenate documents with EOS after each and cut into full blocks; yields (n, seq_len) arrays.
    The tail that does not fill a block is dropped (at most seq_len - 1 tokens per stream)."""
    rest = np.zeros(0, dtype=np.int32)
    for ids in docs:
        stream = np.concatenate([rest, np.asarray(ids, dtype=np.int32), np.array([eos_id], dtype=np.int32)])
        n = len(stream) // seq_len
        if n:
            yield stream[: n * seq_len].reshape(n, seq_len)
        rest = stream[n * seq_len:]


def pack_all(docs: Iterable[list[int]], eos_id: int, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Every block of `docs` as one (n_blocks, seq_len) int32 tensor (at most `limit` blocks)."""
    chunks, count = [], 0
    for chunk in pack(docs, eos_id, seq_len):
        chunks.append(chunk)
        count += len(chunk)
        if limit is not None and count >= limit:
            break
    if not chunks:
        return torch.zeros(0, seq_len, dtype=torch.int32)
    return torch.from_numpy(np.concatenate(chunks)[:limit])


def block_hash(block: torch.Tensor) -> str:
    """Short content hash of one block (for the data-order audit trace)."""
    return hashlib.blake2b(block.to(torch.int32).numpy().tobytes(), digest_size=8).hexdigest()


def rank_slice(blocks: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Every world_size-th block from `rank`, the same count on each rank (collective forwards need it)."""
    usable = len(blocks) // world_size * world_size
    return blocks[rank:usable:world_size]
