"""The calibration blocks `--refine` fits on, their seeded mini-batches, and one layer's activation buffers
(on the device, or memory-mapped files whose room is reserved up front)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.convert.inputs import HOLDOUT_FRACTION, OPENING_LENGTH, OPENINGS_PER_STEP, RefineBudget
from mha2gqa.corpus.blocks import full_blocks
from mha2gqa.runtime.errors import InputError

BUFFERS = ("parent", "converted", "inputs", "targets")


class ActivationBuffers:
    """One layer's (blocks, seq, width) float32 buffers: on `device` when they fit `memory` bytes, else
    memory-mapped files in a temporary folder inside `spill_dir` (removed on close). A spill file's blocks
    are reserved (posix_fallocate) before it is mapped: writing through a mapping of a file the disk has
    no room for kills the process with SIGBUS, where a reservation fails with ENOSPC, an OSError."""

    def __init__(self, blocks: int, seq_len: int, width: int, memory: int, device, spill_dir: Path | None = None):
        shape = (blocks, seq_len, width)
        numel = blocks * seq_len * width
        self.bytes = len(BUFFERS) * numel * 4
        self.spill_dir = None
        self.data = {}
        if self.bytes > memory:
            self.spill_dir = Path(tempfile.mkdtemp(prefix=".refine-", dir=spill_dir))
        try:
            for name in BUFFERS:
                if self.spill_dir is None:
                    self.data[name] = torch.empty(shape, dtype=torch.float32, device=device)
                else:
                    path = self.spill_dir / f"{name}.f32"
                    with open(path, "wb") as f:
                        _reserve(f, numel * 4, path)
                    self.data[name] = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32).view(
                        shape
                    )
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.data[name]

    def swap(self, first: str, second: str) -> None:
        self.data[first], self.data[second] = self.data[second], self.data[first]

    def close(self) -> None:
        self.data.clear()
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)


def _reserve(f, nbytes: int, path: Path) -> None:
    """Allocate the file's blocks now (ENOSPC here, naming the file), not on first write through a mapping."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(f.fileno(), 0, nbytes)
            return
        except OSError as err:
            if err.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: a filesystem without fallocate
                raise OSError(err.errno, err.strerror, str(path)) from err
    free = shutil.disk_usage(path.parent).free
    if free < nbytes:
        raise OSError(28, os.strerror(28), str(path))
    f.truncate(nbytes)


def calibration_blocks(ids: torch.Tensor, budget: RefineBudget) -> tuple[torch.Tensor, dict]:
    """The (n, seq_len) blocks of the calibration `ids` that --refine uses (the budget's tokens, spread evenly
    over the text) and their split: {"fit": indices, "heldout": the last 1/8}."""
    seq_len = budget.seq_len
    blocks = full_blocks(ids, seq_len)
    count = budget.blocks_of(len(blocks))
    if count < len(blocks):  # a subset spread over the whole text
        blocks = blocks[torch.linspace(0, len(blocks) - 1, count).round().long()]
    if len(blocks) < 2:
        raise InputError(
            f"--refine needs at least 2 calibration blocks of {seq_len} tokens, and the calibration data holds "
            f"only {len(ids)} tokens: give more calibration text"
        )
    held = budget.heldout_of(len(blocks))
    return blocks, {"fit": torch.arange(len(blocks) - held), "heldout": torch.arange(len(blocks) - held, len(blocks))}


@dataclass
class Openings:
    """Short sequences whose first tokens cover the vocabulary, fitted beside the blocks (both stages).

    Why: a causal model's first position attends only to itself, so its state is a function of its token
    alone, and the parent builds there the attention sink (on SmolLM2 a hidden state of norm ~700 after the
    third layer, ~24,000 after the twelfth, whatever the token) that every later position leans on. The
    blocks open on a few dozen tokens (a sampled sequence's start, a cut in a text); a merged child fitted
    on them alone kept the sink for those and lost it for others ('#', '[', '(' on SmolLM2: windows of code
    opening there scored 15-17 nats a token where the parent scored 2-3, and which tokens broke changed
    with the draw of the samples). Half the openings start on a token drawn uniformly from the vocabulary
    (every token, special ones too), half on a token of the calibration text at a random place (the tokens
    windows most often open with); the rest of each is the text that follows such a place. The last 1/8
    are held out, as the blocks' are. Their loss, normalised as the blocks', is added to the blocks' times
    `weight` (--refine-opening-weight) wherever the two are fitted or checked together."""

    ids: torch.Tensor  # (n, OPENING_LENGTH)
    split: dict  # {"fit": indices, "heldout": indices}
    per_step: int = OPENINGS_PER_STEP
    weight: float = 1.0

    @property
    def tokens(self) -> int:
        return self.ids.numel()


def opening_sequences(ids: torch.Tensor, vocab_size: int, seed: int, count: int, weight: float = 1.0) -> Openings:
    """`count` openings of OPENING_LENGTH tokens (Openings) from the calibration `ids`, drawn with `seed`, their
    loss weighted `weight` beside the blocks'."""
    generator = torch.Generator().manual_seed(seed)
    length = min(OPENING_LENGTH, len(ids))
    starts = torch.randint(len(ids) - length + 1, (count,), generator=generator)
    rows = ids[starts[:, None] + torch.arange(length)].clone()
    uniform = torch.arange(count) % 2 == 0
    rows[uniform, 0] = torch.randint(vocab_size, (int(uniform.sum()),), generator=generator)
    held = max(1, round(count * HOLDOUT_FRACTION))
    split = {"fit": torch.arange(count - held), "heldout": torch.arange(count - held, count)}
    return Openings(rows, split, min(OPENINGS_PER_STEP, count - held), weight)


def mini_batches(fit: torch.Tensor, size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless batches of `size` of the block indices `fit`: epochs of a permutation drawn from `generator`,
    the next epoch's drawn only when fewer than a batch are left (so a batch spans two epochs rather than
    coming out short). Both Adam stages draw their order from here, and from one generator per conversion."""
    order = torch.empty(0, dtype=torch.long)
    while True:
        if len(order) < min(size, len(fit)):
            order = torch.cat([order, fit[torch.randperm(len(fit), generator=generator)]])
        chunk, order = order[:size], order[size:]
        yield chunk
