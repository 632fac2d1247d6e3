"""Token ids -> fixed-length blocks, for every reader that cuts ids into blocks:

- full_blocks: a stream's whole blocks of seq_len, the tail that fills none left out (calibration's parts,
  --refine's blocks, the batches the statistics are gathered in);
- pack / pack_all: documents' ids with EOS after each, cut into whole blocks without padding (uptrain's text);
- mix_blocks: the blocks of several parts as one, in a named order (MixOrder): the one mix builder of a
  calibration mix, the parent's two kinds of samples (sampling.py) and uptrain's pool of several texts. Each
  order's bytes are pinned (tests/test_corpus_calibration.py).

Importing it imports no torch (the functions import it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch


def full_blocks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(N,) ids -> (N // seq_len, seq_len), a view of the whole blocks in order."""
    return ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)


def pack(docs: Iterable[list[int]], eos_id: int, seq_len: int) -> Iterator[np.ndarray]:
    """Concatenate documents with EOS after each and cut into full blocks; yields (n, seq_len) int32 arrays.
    The tail that does not fill a block is dropped (at most seq_len - 1 tokens per stream)."""
    import numpy as np

    rest = np.zeros(0, dtype=np.int32)
    for ids in docs:
        stream = np.concatenate([rest, np.asarray(ids, dtype=np.int32), np.array([eos_id], dtype=np.int32)])
        n = len(stream) // seq_len
        if n:
            yield stream[: n * seq_len].reshape(n, seq_len)
        rest = stream[n * seq_len :]


def pack_all(docs: Iterable[list[int]], eos_id: int, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Every block of `docs` (pack) as one (n_blocks, seq_len) int32 tensor (at most `limit` blocks, reading
    no document past the one that fills them)."""
    import numpy as np
    import torch

    chunks, count = [], 0
    for chunk in pack(docs, eos_id, seq_len):
        chunks.append(chunk)
        count += len(chunk)
        if limit is not None and count >= limit:
            break
    if not chunks:
        return torch.zeros(0, seq_len, dtype=torch.int32)
    return torch.from_numpy(np.concatenate(chunks)[:limit])


class MixOrder(Enum):
    """How the blocks of several parts follow one another in a mix."""

    SPREAD = "spread"
    """Block i of a part of n blocks at (i + 0.5) / n, ties in part order: any stretch of the result (refine's
    subset, its held-out tail) holds every part in proportion. A calibration mix; the parent's samples."""
    IN_TURN = "in turn"
    """Every block of the first part, then every block of the next: uptrain's pool, which its batches shuffle."""


def mix_blocks(parts: list[torch.Tensor], order: MixOrder) -> torch.Tensor:
    """The blocks of every part, (n_i, seq_len) each, as one (sum n_i, seq_len) in `order`."""
    import torch

    if order is MixOrder.IN_TURN:
        return torch.cat(parts)
    found = spread([len(blocks) for blocks in parts])
    return torch.stack([parts[p][i] for p, i in found]) if found else parts[0][:0]


def spread(counts: list[int]) -> list[tuple[int, int]]:
    """(part, block) for every block of parts holding `counts` blocks, in the SPREAD order."""
    keyed = sorted(((i + 0.5) / n, p, i) for p, n in enumerate(counts) for i in range(n))
    return [(p, i) for _, p, i in keyed]
