"""Calibration statistics: per layer, the second moments C = [X 1]^T [X 1] of the attention input X.

X is what q/k/v_proj read (the normed hidden state); a forward pre-hook on each layer's q_proj (or
fused qkv_proj) adds every batch into a float64 (d+1, d+1) accumulator, so no activation is kept and
the result does not depend on how the tokens were batched. The last row/column hold the token sums
and count, which lets the merge treat biases as one more input column.

Memory: the source model (on the GPU when there is one, else on CPU in float32) plus at most
`memory_bytes` of accumulators; when all layers' (d+1)^2 * 8 bytes do not fit, the tokens go through
the model once per slice of layers. Each layer's statistics are written to `out_dir` as they finish,
and the converter reads one layer at a time (CalibrationStats.layer), so conversion memory stays flat.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mha2gqa.architecture.layouts import AttentionShape, Layout
from mha2gqa.convert.inputs import CALIBRATION_BATCH, block_length, default_tokens, layers_per_pass
from mha2gqa.convert.options import DEFAULT_CALIBRATION_MEMORY
from mha2gqa.corpus.blocks import full_blocks
from mha2gqa.corpus.calibration import CalibrationInput
from mha2gqa.runtime.progress import progress_bar

DEFAULT_MEMORY = DEFAULT_CALIBRATION_MEMORY  # bytes of accumulators held at once


@dataclass(frozen=True)
class LayerStats:
    """What the calibrated merge knows about one layer beyond its weights."""

    gram: torch.Tensor  # (d+1, d+1) float64: [X 1]^T [X 1]; gram[-1, -1] is the token count
    rotary_dims: int  # leading dims of each head that RoPE rotates (rope.rotary_dims)

    @property
    def tokens(self) -> int:
        return int(self.gram[-1, -1])


class GramAccumulator:
    """Streaming [X 1]^T [X 1] in float64: add() chunks of any shape (..., d) in any split."""

    def __init__(self, width: int, device: str | torch.device = "cpu"):
        self.gram = torch.zeros(width + 1, width + 1, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).to(self.gram.device, torch.float64)  # (N, d)
        width = rows.shape[1]
        self.gram[:width, :width].addmm_(rows.T, rows)
        sums = rows.sum(dim=0)  # (d,)
        self.gram[:width, width] += sums
        self.gram[width, :width] += sums
        self.gram[width, width] += rows.shape[0]


@dataclass(frozen=True)
class CalibrationStats:
    """Every layer's statistics, on disk in `directory`; layer(i) loads one."""

    directory: Path
    layers: int
    tokens: int
    rotary_dims: int
    record: dict  # provenance: data, tokens, sequence length, passes, device, sha256 of the ids
    device: str = "cpu"  # where layer() puts the gram, and so where the merge's float64 work runs
    ids: torch.Tensor | None = None  # the calibration ids they were gathered from, so refine needs no second reading

    def layer(self, index: int) -> LayerStats:
        return LayerStats(load_file(_layer_file(self.directory, index), device=self.device)["gram"], self.rotary_dims)


def _layer_file(directory: Path, index: int) -> Path:
    return Path(directory) / f"layer-{index:05d}.safetensors"


def input_module(layout: Layout, layer: int) -> str:
    """The module whose input is layer `layer`'s attention input X."""
    return layout.layer_prefix.format(layer=layer) + (layout.qkv or layout.q)


def _save_gram(gram: torch.Tensor, path: Path) -> None:
    """safetensors reports a full disk as SafetensorError("... (os error 28)"): re-raise such I/O
    failures as the OSError they are, so that the CLI words them as one line naming the place."""
    try:
        save_file({"gram": gram.cpu()}, str(path))
    except SafetensorError as err:
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from err


def collect_statistics(
    model,
    layout: Layout,
    shape: AttentionShape,
    ids: torch.Tensor,
    out_dir: Path,
    rotary_dims: int,
    seq_len: int = 512,
    batch_size: int = CALIBRATION_BATCH,
    memory_bytes: int = DEFAULT_MEMORY,
    progress: bool = True,
) -> CalibrationStats:
    """Run ids (N,) through `model` (a loaded causal LM) and write each layer's gram to out_dir."""
    device = next(model.parameters()).device
    width = model.get_submodule(input_module(layout, 0)).weight.shape[1]
    per_pass = layers_per_pass(memory_bytes, width)
    batches = _batches(ids, seq_len, batch_size)
    passes = range(0, shape.layers, per_pass)
    bar = progress_bar(len(batches) * len(passes), "calibrate", progress, unit="batch")
    for first in passes:
        layers = range(first, min(first + per_pass, shape.layers))
        sums = {layer: GramAccumulator(width, device) for layer in layers}
        handles = [
            model.get_submodule(input_module(layout, layer)).register_forward_pre_hook(
                lambda module, args, acc=sums[layer]: acc.add(args[0])
            )
            for layer in layers
        ]
        try:
            with torch.no_grad():
                for batch in batches:
                    model.base_model(batch.to(device), use_cache=False)  # no lm_head: only X is wanted
                    bar.update(1)
        finally:
            for handle in handles:
                handle.remove()
        for layer, acc in sums.items():
            _save_gram(acc.gram, _layer_file(out_dir, layer))
    bar.close()
    record = {
        "tokens": len(ids),
        "sequence_length": seq_len,
        "passes": len(passes),
        "device": str(device),
        "ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
    }
    return CalibrationStats(Path(out_dir), shape.layers, len(ids), rotary_dims, record, str(device))


def _batches(ids: torch.Tensor, seq_len: int, batch_size: int) -> list[torch.Tensor]:
    """(N,) -> batches (B, seq_len) of consecutive blocks; a shorter last block is a batch of its own."""
    full = full_blocks(ids, seq_len)
    batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    if len(ids) % seq_len:
        batches.append(ids[len(full) * seq_len :][None])
    return batches


def calibrate(
    source: Path,
    layout: Layout,
    shape: AttentionShape,
    data,
    tokens: int | None,
    out_dir: Path,
    memory_bytes: int = DEFAULT_MEMORY,
    progress: bool = True,
    seed: int = 0,
) -> CalibrationStats:
    """Read `tokens` calibration ids of `data` (files, folders, a hub dataset, 'austen', 'parent' or a mix:
    corpus/calibration.py; None: convert's default) and collect statistics, to pass to every convert(..., stats=...)
    (as a sweep does with its own). `seed` seeds the parent's samples."""
    from mha2gqa.architecture.layouts import read_config
    from mha2gqa.corpus.calibration import resolve_calibration

    calibration = resolve_calibration(data, tokens, block_length(read_config(source)), default_tokens(shape.hidden))
    return statistics(calibration, source, layout, shape, out_dir, None, memory_bytes, progress, seed)


def statistics(
    calibration: CalibrationInput,
    source: Path,
    layout: Layout,
    shape: AttentionShape,
    out_dir: Path,
    device: str | None = None,
    memory_bytes: int = DEFAULT_MEMORY,
    progress: bool = True,
    seed: int = 0,
) -> CalibrationStats:
    """The parent loaded (on `device`, None: source_device), the calibration read through it, its statistics
    gathered: a whole calibration pass (calibrate, a sweep's once for all its candidates)."""
    from mha2gqa.corpus.calibration import read_calibration

    model = load_source_model(source, device, progress=progress)
    ids, record = read_calibration(calibration, source, seed, lambda: model, progress=progress)
    return gather(model, calibration, ids, record, layout, shape, source, out_dir, memory_bytes, progress)


def gather(
    model,
    calibration: CalibrationInput,
    ids: torch.Tensor,
    record: dict,
    layout: Layout,
    shape: AttentionShape,
    source: Path,
    out_dir: Path,
    memory_bytes: int = DEFAULT_MEMORY,
    progress: bool = True,
) -> CalibrationStats:
    """The statistics of `ids` through the loaded source `model`; `record` (read_calibration) says what they are."""
    from mha2gqa.convert.rope import rotary_dims

    stats = collect_statistics(
        model,
        layout,
        shape,
        ids,
        out_dir,
        rotary_dims(source, shape.head_dim),
        seq_len=calibration.seq_len,
        memory_bytes=memory_bytes,
        progress=progress,
    )
    return replace(stats, record={**record, "rotary_dims": stats.rotary_dims, **stats.record}, ids=ids)


def source_device() -> str:
    """Where the parent runs when the caller has not decided (calibrate(), a library call): the GPU when there is
    one, else the CPU; convert and sweep pass the device their plan decided (convert/decide.py), by the same rule."""
    from mha2gqa.runtime.machine import torch_device

    return torch_device()


def load_source_model(model_dir: Path, device: str | None = None, progress: bool = True):
    """The source causal LM for calibration: the GPU in the checkpoint's dtype when there is one, else
    CPU in float32 (fast and exact enough for statistics accumulated in float64)."""
    from mha2gqa.files.loading import load_causal_lm

    device = device or source_device()
    dtype = "auto" if device != "cpu" else torch.float32
    # Refuses missing/unexpected/wrong-shape tensors: random ones would poison the statistics.
    return load_causal_lm(model_dir, "SRC", progress=progress, dtype=dtype).to(device).eval()
