"""`convert --refine`: layer-wise reconstruction of the attention output after the merge.

The merge matches K/V projections one at a time; it never sees what the attention layer outputs
through the softmax, nor the drift that earlier layers' errors cause in later layers' inputs. Here,
layer by layer and in order (the GPTQ habit, with the softmax inside):
  target = the parent's attention output on the parent's own hidden states;
  input  = the attention input of the converted model, whose layers below are already refined;
and the converted layer's attention module (every parameter it has: projections, biases, per-head
norms) is fitted to the target. The module is transformers' own, called as the model calls it, so
every layout the merge supports is refined exactly as it runs and the checkpoint keeps its shapes.

Cost is linear in depth: the parent's embeddings give the first layer's input (forwards stopped at
layer 0); after that both models' hidden states are carried forward one layer at a time (never
re-running the prefix). The fit uses `tokens` of the calibration tokens (default 128 x hidden).
Nothing is read back from disk: the converted model is the parent's modules with the merged attention
(every other tensor shared with the loaded parent, or its --dtype cast), and the refined tensors go to
run.py's one writer pass. Memory: the parent, the converted attention, and four (tokens, hidden)
float32 buffers for the current layer (parent and converted hidden states, the converted attention
input, the target), on the device when they fit in `memory` bytes, else memory-mapped files inside
DST's partial folder, their room reserved up front (a full disk is one error line, not a SIGBUS in
the middle) and removed with a killed run's other debris. The last 1/8 of the calibration blocks are
held out: each layer's relative output error is reported on fit and held-out tokens, before and after.

The fit (chosen by measurement, docs/refine.md): Adam on the normalised MSE
||attn(x) - t||^2 / mean ||t||^2 over random mini-batches of blocks, cosine-decayed learning rate,
then a closed-form least-squares solve of o_proj given the rest. A layer whose fit or held-out
error would rise (or went non-finite: said so) is left as merged, so a model that is already exact
stays exact and a layer that overfits too few calibration tokens is not made worse.

Then (by default; `--refine-global-steps 0` turns it off) the global stage, global_stage.py: the layers
whose refit was kept, all together, against the parent's next-token distribution on the same blocks.

The package: buffers.py (the blocks, their mini-batches, one layer's activation buffers), model.py (the
converted model), hooks.py (running the models layer by layer), attention.py (the attention fit) and
global_stage.py; this module runs them layer by layer.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mha2gqa.architecture.layouts import AttentionShape, Layout
from mha2gqa.convert.inputs import RefineBudget, opening_count
from mha2gqa.convert.options import RefineOptions
from mha2gqa.convert.refine.attention import EXACT, Side, fit_attention, relative
from mha2gqa.convert.refine.buffers import BUFFERS, ActivationBuffers, Openings, calibration_blocks, opening_sequences
from mha2gqa.convert.refine.global_stage import GlobalFit, fit_global
from mha2gqa.convert.refine.hooks import advance, first_hidden_states, layer_targets
from mha2gqa.convert.refine.model import attention_path, converted_model, layer_path
from mha2gqa.estimates.clock import NO_CLOCK
from mha2gqa.estimates.stages import CONVERT
from mha2gqa.runtime.errors import WeightWarning
from mha2gqa.runtime.progress import progress_bar

__all__ = [
    "BUFFERS",
    "EXACT",
    "ActivationBuffers",
    "GlobalFit",
    "RefineOptions",
    "calibration_blocks",
    "converted_model",
    "fit_attention",
    "fit_global",
    "refine_attention",
]


def refine_attention(
    parent,
    layout: Layout,
    shape: AttentionShape,
    config: dict,
    merged: dict[str, torch.Tensor],
    ids: torch.Tensor,
    options: RefineOptions,
    budget: RefineBudget,
    out_dtype: str | None = None,
    spill_dir: Path | None = None,
    progress: bool = True,
    clock=NO_CLOCK,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Refine the merged attention layer by layer against the loaded `parent`. config: the converted
    config.json; merged: the merge's tensors by checkpoint name, in their output dtype; budget: the blocks
    to fit on, as the plan computed them (prepare); out_dtype: --dtype; clock: the run's estimates Clock (the
    layers' progress, and the global stage's start).
    Returns every layer's refined attention tensors by checkpoint name, and the JSON-able record: options,
    token counts and per-layer errors."""
    started, started_cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(options.seed)
    parent.requires_grad_(False)
    model = converted_model(parent, layout, shape, config, merged, out_dtype)
    blocks, split = calibration_blocks(ids, budget)
    count = opening_count(blocks.numel())
    vocab = parent.get_input_embeddings().num_embeddings
    openings = opening_sequences(ids, vocab, options.seed, count, options.opening_weight)
    device = next(model.parameters()).device
    held: list[ActivationBuffers] = []  # every set's buffers, closed at the end whatever happens
    layers, refined, changed, global_record = [], {}, {}, None
    bar = progress_bar(shape.layers * max(options.steps, 1), "refine", progress, unit="step", leave=False)
    try:
        carry = (parent, layout, shape, options.memory, device, spill_dir, held)
        buffers, layer_kwargs = _carried(*carry, blocks, options.batch_blocks)
        opening_batch = _opening_batch(openings, budget, options)
        opening_buffers, opening_kwargs = _carried(*carry, openings.ids, opening_batch)
        generator = torch.Generator().manual_seed(options.seed)
        opened = _OpeningRun(openings, opening_buffers, opening_kwargs, opening_batch)
        run = _Run(parent, model, layout, buffers, split, options, generator, bar, layer_kwargs, opened)
        for index in range(shape.layers):
            bar.set_description(f"refine layer {index + 1}/{shape.layers}", refresh=False)
            report, names, kept = _refine_layer(run, index)
            layers.append(report)
            refined.update(names)
            # What the global stage may train: the layers whose refit was kept. One left as merged (worse,
            # non-finite) stays as merged, so a conversion whose every refit failed is the plain merge.
            if kept:
                changed.update(names)
            clock.partial((index + 1) / shape.layers)
        if options.global_steps and changed:
            clock.stage(CONVERT.refine_global.name)
            global_record = _global_stage(run, changed, blocks, progress)
    finally:
        bar.close()
        for each in held:
            each.close()
    timing = {"wall_s": round(time.perf_counter() - started, 2), "cpu_s": round(time.process_time() - started_cpu, 2)}
    return refined, _record(run, budget.seq_len, timing, layers, global_record)


@dataclass
class _OpeningRun:
    """The openings (buffers.Openings) as the layer loop carries them: their activation buffers, each layer's
    keyword arguments at their length, and how many go through a layer at once."""

    openings: Openings
    buffers: ActivationBuffers
    layer_kwargs: dict[int, dict]
    batch: int


def _carried(parent, layout, shape, memory, device, spill_dir, held: list, ids: torch.Tensor, batch: int):
    """Activation buffers for the sequences `ids` (joining `held`, which the caller closes), the first layer's
    input in both the parent's and the converted states, and each layer's keyword arguments at their length."""
    buffers = ActivationBuffers(len(ids), ids.shape[1], shape.hidden, memory, device, spill_dir)
    held.append(buffers)
    layer_kwargs = first_hidden_states(parent, layout, shape.layers, ids, buffers, batch)
    buffers["converted"].copy_(buffers["parent"])
    return buffers, layer_kwargs


def _opening_batch(openings: Openings, budget: RefineBudget, options: RefineOptions) -> int:
    """Openings per forward when the layer loop moves them: as many tokens as a batch of blocks."""
    return max(1, options.batch_blocks * budget.seq_len // openings.ids.shape[1])


@dataclass
class _Run:
    """What every layer's refit shares: both models, the activation buffers, the fit / held-out split, the
    options, the one seeded generator of the mini-batch orders, the progress bar, each layer's keyword
    arguments (masks, rotary tables), and the openings fitted beside the blocks."""

    parent: torch.nn.Module
    model: torch.nn.Module
    layout: Layout
    buffers: ActivationBuffers
    split: dict
    options: RefineOptions
    generator: torch.Generator
    bar: object  # a progress bar (mha2gqa.runtime.progress)
    layer_kwargs: dict[int, dict]
    openings: _OpeningRun


@dataclass
class _Sequences:
    """One set of sequences as one layer's refit carries it (the blocks, or the openings): its buffers, its
    fit / held-out split, how many go through the layer at once, the layer's keyword arguments at their length,
    and the parent's target power per sequence (set by targets)."""

    buffers: ActivationBuffers
    split: dict
    batch: int
    kwargs: dict
    power: torch.Tensor | None = None

    def targets(self, parent_layer, layer, layout: Layout) -> tuple[dict, float, float]:
        """The parent's attention outputs and the converted attention's inputs into the buffers (hooks.layer_targets);
        returns the attention's keyword arguments and the merged layer's fit and held-out errors."""
        attn_kwargs, errors, self.power = layer_targets(
            parent_layer, layer, layout, self.kwargs, self.buffers, self.batch
        )
        return attn_kwargs, *self._errors(errors)

    def advance(self, layer, layout: Layout) -> tuple[float, float]:
        """The converted states through the layer as it now is (hooks.advance); its fit and held-out errors."""
        return self._errors(advance(layer, layout, self.kwargs, self.buffers, self.batch))

    def _errors(self, errors: torch.Tensor) -> tuple[float, float]:
        return relative(errors, self.power, self.split["fit"]), relative(errors, self.power, self.split["heldout"])


def _refine_layer(run: _Run, index: int) -> tuple[dict, dict[str, torch.Tensor], bool]:
    """Refit layer `index` and move both models' hidden states past it. Returns the layer's report (its
    relative errors before and after, on fit and held-out blocks and on the openings), its tensors by
    checkpoint name, and whether the refit was kept."""
    layout, options, opened = run.layout, run.options, run.openings
    blocks = _Sequences(run.buffers, run.split, options.batch_blocks, run.layer_kwargs[index])
    openings = _Sequences(opened.buffers, opened.openings.split, opened.batch, opened.layer_kwargs[index])
    parent_layer, layer = (m.get_submodule(layer_path(layout, index)) for m in (run.parent, run.model))
    attn = layer.get_submodule(attention_path(layout))
    attn_kwargs, *block_before = blocks.targets(parent_layer, layer, layout)
    side_kwargs, *side_before = openings.targets(parent_layer, layer, layout)
    kept = {name: p.detach().clone() for name, p in attn.named_parameters()}
    # below EXACT the merge is exact up to rounding (at every position): Adam would only add noise
    fitted = block_before[0] + side_before[0] > EXACT
    if fitted:
        side_data = opened.buffers["inputs"], opened.buffers["targets"], openings.split["fit"]
        side = Side(side_kwargs, *side_data, opened.openings.per_step, opened.openings.weight)
        inputs, targets, fit = run.buffers["inputs"], run.buffers["targets"], run.split["fit"]
        fit_attention(attn, layout, attn_kwargs, inputs, targets, fit, options, run.generator, index, run.bar, side)
    run.bar.update(max(options.steps, 1) if not fitted or options.steps == 0 else 0)
    # The next converted states go into the inputs buffers (free once the fit is done), measuring the layer's
    # errors on the way; the buffers then swap roles.
    block_after, side_after = blocks.advance(layer, layout), openings.advance(layer, layout)
    # Kept only if better on the fit sequences (an exact merge stays exact) and on the held-out ones (a layer
    # that overfits too few calibration tokens is left as merged), blocks and openings together: the blocks'
    # relative error plus the openings' times their weight is what the fit lowers.
    outcome = "exact" if not fitted else "refined"
    weight = opened.openings.weight
    total_before, total_after = (
        tuple(b + weight * s for b, s in zip(block, side))
        for block, side in ((block_before, side_before), (block_after, side_after))
    )
    if fitted and not (total_after[0] < total_before[0] and total_after[1] < total_before[1]):
        outcome = _lost(index, *total_after, options)
        _restore(attn, kept)
        for sequences in (blocks, openings):
            sequences.advance(layer, layout)
        block_after, side_after = block_before, side_before
    for sequences in (blocks, openings):
        sequences.buffers.swap("converted", "inputs")
    report = {"layer": index, "fit_error_before": block_before[0], "fit_error_after": block_after[0]}
    report.update(heldout_error_before=block_before[1], heldout_error_after=block_after[1])
    report.update(opening_heldout_error_before=side_before[1], opening_heldout_error_after=side_after[1])
    if outcome in ("worse", "non-finite"):
        report["kept_merged"] = outcome
    return report, _tensor_names(layout, index, attn), outcome == "refined"


def _lost(index: int, fit_after: float, held_after: float, options: RefineOptions) -> str:
    """Why a refit is not kept: "worse", or "non-finite" (said in a warning, which names the fix)."""
    if math.isfinite(fit_after) and math.isfinite(held_after):
        return "worse"
    warnings.warn(
        f"refine: layer {index}'s refit went non-finite (NaN/inf output error): the layer is kept "
        f"as merged; lower --refine-lr ({options.lr:g})",
        WeightWarning,
        stacklevel=4,  # refine_attention's caller, as before the layer loop was split out
    )
    return "non-finite"


def _global_stage(run: _Run, refined: dict, blocks: torch.Tensor, progress: bool) -> dict:
    """Every parameter the layer-wise stages changed, all layers together, against the parent's
    next-token distribution (global_stage.py). `refined`: checkpoint name -> the live parameter data."""
    by_data = {p.data_ptr(): p for p in run.model.parameters()}
    params = [by_data[t.data_ptr()] for t in refined.values()]
    fit = GlobalFit.of(run.options)
    openings = run.openings.openings
    return fit_global(
        run.parent,
        run.model,
        params,
        blocks,
        run.split,
        fit,
        run.generator,
        progress=progress,
        openings=openings,
        memory=run.options.memory,  # the layer buffers are freed by now: their budget keeps the parent's logits
    )


def _record(run: _Run, seq_len: int, timing: dict, layers: list[dict], global_record: dict | None) -> dict:
    """The JSON-able record of the refine stage (mha2gqa.json's "refine")."""
    tokens = {name: len(idx) * seq_len for name, idx in run.split.items()}
    return {
        "options": asdict(run.options),
        "sequence_length": seq_len,
        "fit_tokens": tokens["fit"],
        "heldout_tokens": tokens["heldout"],
        "openings": _openings_record(run.openings.openings),
        "device": str(next(run.model.parameters()).device),
        "spilled_to_disk": run.buffers.spill_dir is not None,
        "buffer_bytes": run.buffers.bytes,
        **timing,
        "layers": layers,
        "global": global_record,
    }


def _openings_record(openings: Openings) -> dict:
    return {
        "sequences": len(openings.ids),
        "length": openings.ids.shape[1],
        "heldout": len(openings.split["heldout"]),
        "per_step": openings.per_step,
        "weight": openings.weight,
    }


def _restore(module, saved: dict) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(saved[name])


def _tensor_names(layout: Layout, index: int, attn) -> dict[str, torch.Tensor]:
    """The refined attention parameters under their checkpoint names."""
    prefix = layout.layer_prefix.format(layer=index) + attention_path(layout) + "."
    return {prefix + name: p.detach() for name, p in attn.named_parameters()}
