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
re-running the prefix). The fit uses `tokens` of the calibration tokens (default 64 x hidden).
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

Then (by default; `--refine-global-steps 0` turns it off) the global stage, refine_global.py: the layers
whose refit was kept, all together, against the parent's next-token distribution on the same blocks.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mha2gqa.convert.inputs import RefineBudget
from mha2gqa.convert.options import OUT_DTYPES, RefineOptions
from mha2gqa.convert.refine_block import BlockStage
from mha2gqa.errors import InputError, WeightWarning
from mha2gqa.layouts import AttentionShape, Layout

EXACT = 1e-10  # relative output error treated as exact
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


def calibration_blocks(ids: torch.Tensor, budget: RefineBudget) -> tuple[torch.Tensor, dict]:
    """The (n, seq_len) blocks of the calibration `ids` that --refine uses (the budget's tokens, spread evenly
    over the text) and their split: {"fit": indices, "heldout": the last 1/8}."""
    seq_len = budget.seq_len
    blocks = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)  # full blocks only
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
) -> tuple[dict[str, torch.Tensor], dict]:
    """Refine the merged attention layer by layer against the loaded `parent`. config: the converted
    config.json; merged: the merge's tensors by checkpoint name, in their output dtype; budget: the blocks
    to fit on, as the plan computed them (prepare); out_dtype: --dtype.
    Returns every layer's refined attention tensors by checkpoint name, and the JSON-able record: options,
    token counts and per-layer errors."""
    started, started_cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(options.seed)
    parent.requires_grad_(False)
    model = converted_model(parent, layout, shape, config, merged, out_dtype)
    run_device = next(model.parameters()).device
    seq_len = budget.seq_len
    blocks, split = calibration_blocks(ids, budget)
    buffers = ActivationBuffers(len(blocks), seq_len, shape.hidden, options.memory, run_device, spill_dir)
    generator = torch.Generator().manual_seed(options.seed)
    layers, refined, changed, global_record = [], {}, {}, None
    bar = tqdm(
        total=shape.layers * max(options.steps, 1), desc="refine", unit="step", disable=not progress, leave=False
    )
    try:
        layer_kwargs = _first_hidden_states(parent, layout, shape.layers, blocks, buffers, options.batch_blocks)
        buffers["converted"].copy_(buffers["parent"])
        for index in range(shape.layers):
            bar.set_description(f"refine layer {index + 1}/{shape.layers}", refresh=False)
            kwargs = layer_kwargs[index]
            parent_layer, layer = (m.get_submodule(_layer_path(layout, index)) for m in (parent, model))
            attn_kwargs, before, power = _layer_targets(
                parent_layer, layer, layout, kwargs, buffers, options.batch_blocks
            )
            attn = layer.get_submodule(_attention_path(layout))
            fit_before, held_before = (_relative(before, power, split[part]) for part in ("fit", "heldout"))
            kept = {name: p.detach().clone() for name, p in attn.named_parameters()}
            fitted = fit_before > EXACT  # below it the merge is exact up to rounding: Adam would only add noise
            if fitted:
                fit_attention(
                    attn,
                    layout,
                    attn_kwargs,
                    buffers["inputs"],
                    buffers["targets"],
                    split["fit"],
                    options,
                    generator,
                    index,
                    bar,
                )
            bar.update(max(options.steps, 1) if not fitted or options.steps == 0 else 0)
            # The block stage's least squares accumulates from the pass that advances the converted states.
            block = BlockStage(layer, kwargs, buffers, split, options) if options.mlp_output and fitted else None
            # The next converted states go into the inputs buffer (free once the fit is done), measuring
            # the refined layer's errors on the way; the buffers then swap roles.
            after = _advance(layer, layout, kwargs, buffers, options.batch_blocks, block)
            fit_after, held_after = (_relative(after, power, split[part]) for part in ("fit", "heldout"))
            # Kept only if better on the fit blocks (an exact merge stays exact) and on the held-out ones
            # (a layer that overfits too few calibration tokens is left as merged).
            outcome = "exact" if not fitted else "refined"
            if fitted and not (fit_after < fit_before and held_after < held_before):
                outcome = "non-finite" if not (math.isfinite(fit_after) and math.isfinite(held_after)) else "worse"
                if outcome == "non-finite":
                    warnings.warn(
                        f"refine: layer {index}'s refit went non-finite (NaN/inf output error): the layer is kept "
                        f"as merged; lower --refine-lr ({options.lr:g})",
                        WeightWarning,
                        stacklevel=2,
                    )
                _restore(attn, kept)
                block = BlockStage(layer, kwargs, buffers, split, options) if block else None
                _advance(layer, layout, kwargs, buffers, options.batch_blocks, block)
                fit_after, held_after = fit_before, held_before
            solved, block_report = {}, {}
            if block is not None:
                solved, block_report = block.finish(
                    partial(_advance, layer, layout, kwargs, buffers, options.batch_blocks)
                )
            buffers.swap("converted", "inputs")
            names = _tensor_names(layout, index, attn, solved)
            refined.update(names)
            # What the global stage may train: the layers whose refit was kept. One left as merged (worse,
            # non-finite) stays as merged, so a conversion whose every refit failed is the plain merge.
            if outcome == "refined":
                changed.update(names)
            report = {
                "fit_error_before": fit_before,
                "fit_error_after": fit_after,
                "heldout_error_before": held_before,
                "heldout_error_after": held_after,
                **block_report,
            }
            if outcome in ("worse", "non-finite"):
                report["kept_merged"] = outcome
            layers.append({"layer": index, **report})
        if options.global_steps and changed:
            global_record = _global_stage(parent, model, changed, blocks, split, options, generator, progress)
    finally:
        bar.close()
        buffers.close()
    tokens = {name: len(idx) * seq_len for name, idx in split.items()}
    return refined, {
        "options": asdict(options),
        "sequence_length": seq_len,
        "fit_tokens": tokens["fit"],
        "heldout_tokens": tokens["heldout"],
        "device": str(run_device),
        "spilled_to_disk": buffers.spill_dir is not None,
        "buffer_bytes": buffers.bytes,
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(time.process_time() - started_cpu, 2),
        "layers": layers,
        "global": global_record,
    }


def converted_model(parent, layout: Layout, shape: AttentionShape, config: dict, merged: dict, out_dtype=None):
    """The converted model as loading the written checkpoint would give it, without writing it: the
    parent's classes built for `config` on the meta device, then every tensor assigned: the merged
    attention (in the parent's dtype), the rest the parent's own (shared: refine never changes them) or,
    with --dtype, their cast and back (what the checkpoint stores). Attention tensors are copies, since
    refine fits them in place."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from mha2gqa.checkpoint import DTYPES

    cast = DTYPES[OUT_DTYPES[out_dtype]] if out_dtype else None
    attention = tuple(layout.layer_prefix.format(layer=i) + _attention_path(layout) + "." for i in range(shape.layers))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            type(parent.config).from_dict(config),
            dtype=next(parent.parameters()).dtype,
            attn_implementation=parent.config._attn_implementation,
        )
    unknown = sorted(set(merged) - set(model.state_dict()))
    if unknown:
        raise InputError(
            f"refine: {unknown[0]} is not a tensor of the converted model: the checkpoint's names do not match it"
        )
    source = parent.state_dict()
    state = {}
    for name in model.state_dict():  # a per-head key norm past the new count (stablelm) is left behind
        if name in merged:
            state[name] = merged[name].to(source[name].device, source[name].dtype)
            continue
        tensor = source[name]
        if cast is not None and tensor.is_floating_point():
            tensor = tensor.to(cast).to(tensor.dtype)
        state[name] = tensor.clone() if name.startswith(attention) else tensor
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(next(parent.parameters()).device).eval().requires_grad_(False)


def _layer_path(layout: Layout, index: int) -> str:
    return layout.layer_prefix.format(layer=index).rstrip(".")


def _attention_path(layout: Layout) -> str:
    """The attention module relative to the layer: the parent of o_proj (self_attn in every layout)."""
    return layout.o.rsplit(".", 1)[0]


def _batch_one(value, batch: int):
    """Captured call arguments with any per-sequence batch dim cut to 1: every block has the same
    positions and no padding, so masks and rotary tables broadcast to any batch."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch and batch > 1:
        return value[:1]
    if isinstance(value, tuple):
        return tuple(_batch_one(v, batch) for v in value)
    return value


def _capture_kwargs(kwargs: dict, batch: int) -> dict:
    return {key: _batch_one(value, batch) for key, value in kwargs.items() if key != "hidden_states"}


class _StopForward(Exception):
    """Raised by a hook once it has what it needs, to skip the rest of a forward pass."""


def _first_hidden_states(parent, layout: Layout, n_layers: int, blocks: torch.Tensor, buffers, batch_blocks: int):
    """The first layer's input for every block into buffers['parent'] (each forward stops at the first
    layer, so this costs the embeddings only), and the keyword arguments the model passes to each layer
    (masks, rotary tables), from one full forward of a single block."""
    device = next(parent.parameters()).device
    layer_kwargs: dict[int, dict] = {}
    cursor = {"start": 0}

    def keep_input(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        start = cursor["start"]
        buffers["parent"][start : start + len(hidden)] = hidden.float().to(buffers["parent"].device)
        raise _StopForward

    def keep_kwargs(index):
        def hook(module, args, kwargs):
            layer_kwargs[index] = _capture_kwargs(kwargs, (args[0] if args else kwargs["hidden_states"]).shape[0])

        return hook

    layers = [parent.get_submodule(_layer_path(layout, i)) for i in range(n_layers)]
    with torch.no_grad():
        handles = [layer.register_forward_pre_hook(keep_kwargs(i), with_kwargs=True) for i, layer in enumerate(layers)]
        try:
            parent.base_model(blocks[:1].to(device), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        handle = layers[0].register_forward_pre_hook(keep_input, with_kwargs=True)
        try:
            for start in range(0, len(blocks), batch_blocks):
                cursor["start"] = start
                try:
                    parent.base_model(blocks[start : start + batch_blocks].to(device), use_cache=False)
                except _StopForward:
                    pass
        finally:
            handle.remove()
    return layer_kwargs


def _call_layer(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _block_errors(out, targets: torch.Tensor, start: int, errors: torch.Tensor) -> None:
    """Per-block squared error of an attention output against the targets, into errors[start:...]."""
    out = out[0] if isinstance(out, tuple) else out
    t = targets[start : start + len(out)].to(out.device)
    errors[start : start + len(out)] = (out.float() - t).double().pow(2).sum((1, 2)).cpu()


def _relative(errors: torch.Tensor, power: torch.Tensor, blocks: torch.Tensor) -> float:
    """sum ||attn(x) - t||^2 / sum ||t||^2 over `blocks`."""
    total = float(power[blocks].sum())
    return float(errors[blocks].sum()) / total if total > 0 else 0.0


def _layer_targets(parent_layer, layer, layout: Layout, kwargs: dict, buffers, batch_blocks: int):
    """Advance the parent's hidden states through its layer, keeping its attention output as the
    target; run the converted layer on its own hidden states up to the end of its attention, keeping
    its attention input and the merged attention's error. Returns the keyword arguments the layer passes to its attention module,
    and per block the squared error (blocks,) and the target power (blocks,), float64."""
    path = _attention_path(layout)
    parent_attn, attn = parent_layer.get_submodule(path), layer.get_submodule(path)
    cursor = {"start": 0}
    attn_kwargs: dict = {}
    blocks = len(buffers["parent"])
    errors, power = torch.zeros(blocks, dtype=torch.float64), torch.zeros(blocks, dtype=torch.float64)
    device = next(layer.parameters()).device

    def keep_target(module, args, kwargs, output):
        start = cursor["start"]
        out = output[0] if isinstance(output, tuple) else output
        buffers["targets"][start : start + len(out)] = out.float().to(buffers["targets"].device)
        power[start : start + len(out)] = out.double().pow(2).sum((1, 2)).cpu()

    def keep_input(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        start = cursor["start"]
        buffers["inputs"][start : start + len(hidden)] = hidden.float().to(buffers["inputs"].device)
        if not attn_kwargs:
            attn_kwargs.update(_capture_kwargs(kwargs, len(hidden)))

    handles = [
        parent_attn.register_forward_hook(keep_target, with_kwargs=True),
        attn.register_forward_pre_hook(keep_input, with_kwargs=True),
        attn.register_forward_hook(lambda m, a, out: _block_errors(out, buffers["targets"], cursor["start"], errors)),
    ]
    handles.append(attn.register_forward_hook(_stop))  # the converted layer's MLP is not needed here
    dtype = next(layer.parameters()).dtype
    try:
        with torch.no_grad():
            for start in range(0, blocks, batch_blocks):
                cursor["start"] = start
                end = start + batch_blocks
                hidden = buffers["parent"][start:end].to(device, dtype)
                buffers["parent"][start:end] = (
                    _call_layer(parent_layer, hidden, kwargs).float().to(buffers["parent"].device)
                )
                try:
                    _call_layer(layer, buffers["converted"][start:end].to(device, dtype), kwargs)
                except _StopForward:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return attn_kwargs, errors, power


def _global_stage(parent, model, refined: dict, blocks, split, options: RefineOptions, generator, progress: bool):
    """Every parameter the layer-wise stages changed, all layers together, against the parent's
    next-token distribution (refine_global.py). `refined`: checkpoint name -> the live parameter data."""
    from mha2gqa.convert.refine_global import fit_global

    by_data = {p.data_ptr(): p for p in model.parameters()}
    params = [by_data[t.data_ptr()] for t in refined.values()]
    return fit_global(
        parent,
        model,
        params,
        blocks,
        split,
        options.global_steps,
        options.global_lr,
        options.batch_blocks,
        generator,
        progress=progress,
    )


def _restore(module, saved: dict) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(saved[name])


def _stop(*_):
    raise _StopForward


def _advance(layer, layout: Layout, kwargs: dict, buffers, batch_blocks: int, block=None) -> torch.Tensor:
    """buffers['converted'] through the (refined) layer into buffers['inputs']; returns the attention's
    squared error per block against buffers['targets'] on the way. `block` (a BlockStage), when given,
    accumulates its least squares from each batch's layer output."""
    source, dest = buffers["converted"], buffers["inputs"]
    device, dtype = next(layer.parameters()).device, next(layer.parameters()).dtype
    errors = torch.zeros(len(source), dtype=torch.float64)
    cursor = {"start": 0}
    handle = layer.get_submodule(_attention_path(layout)).register_forward_hook(
        lambda m, a, out: _block_errors(out, buffers["targets"], cursor["start"], errors)
    )
    try:
        with torch.no_grad():
            for start in range(0, len(source), batch_blocks):
                cursor["start"] = start
                end = start + batch_blocks
                out = _call_layer(layer, source[start:end].to(device, dtype), kwargs)
                if block is not None:
                    block.add(start, out)
                dest[start:end] = out.float().to(dest.device)
    finally:
        handle.remove()
    return errors


def _attention_output(attn, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = attn(hidden_states=x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def fit_attention(
    attn,
    layout: Layout,
    kwargs: dict,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    fit: torch.Tensor,
    options: RefineOptions,
    generator: torch.Generator,
    index: int = 0,
    bar=None,
) -> None:
    """Fit `attn`'s parameters so that attn(inputs) ~= targets on the blocks `fit`: Adam, then the
    closed-form o_proj. Runs in float32 whatever the checkpoint's dtype. bar: the overall progress bar,
    advanced one step per Adam step."""
    dtype = next(attn.parameters()).dtype
    attn.float()
    _adam(attn, kwargs, inputs, targets, fit, options, generator, bar)
    if options.solve_output:
        _solve_output(attn, layout, kwargs, inputs, targets, fit, options.batch_blocks)
    attn.to(dtype)


def _adam(attn, kwargs, inputs, targets, fit: torch.Tensor, options: RefineOptions, generator, bar=None) -> None:
    if options.steps == 0:
        return
    device = next(attn.parameters()).device
    params = [p for p in attn.parameters()]
    for p in params:
        p.requires_grad_(True)
    power = float(
        sum(targets[chunk].double().pow(2).mean(-1).sum() for chunk in fit.split(options.batch_blocks))
        / (len(fit) * targets.shape[1])
    )  # mean ||t||^2 per token: the loss is scale-free
    optimizer = torch.optim.Adam(params, lr=options.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / options.steps)))
    width = targets.shape[-1]
    order = torch.empty(0, dtype=torch.long)
    try:
        for _ in range(options.steps):
            if len(order) < min(options.batch_blocks, len(fit)):  # epochs of a seeded permutation
                order = torch.cat([order, fit[torch.randperm(len(fit), generator=generator)]])
            chunk, order = order[: options.batch_blocks], order[options.batch_blocks :]
            x, t = inputs[chunk].to(device), targets[chunk].to(device)
            loss = (_attention_output(attn, x, kwargs) - t).pow(2).sum(-1).mean() / power
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            if bar is not None:
                # The loss sums the error over hidden and divides by the mean power per hidden unit: divided
                # by the width it is the relative error of this batch, the quantity of the per-layer table.
                bar.set_postfix(error=f"{loss.item() / width:.4f}", refresh=False)
                bar.update(1)
    finally:
        for p in params:
            p.requires_grad_(False)


def _solve_output(attn, layout: Layout, kwargs, inputs, targets, fit: torch.Tensor, batch_blocks: int) -> None:
    """o_proj (and its bias, when it has one) by least squares given everything before it: accumulate
    A^T A and A^T T over the fit blocks (A: o_proj's input Z, with a ones column for the bias), solve
    in float64 with a tiny ridge."""
    o_proj = attn.get_submodule(layout.o.rsplit(".", 1)[1])
    device, has_bias = o_proj.weight.device, o_proj.bias is not None
    width = o_proj.weight.shape[1] + has_bias
    gram = torch.zeros(width, width, dtype=torch.float64, device=device)
    cross = torch.zeros(width, o_proj.weight.shape[0], dtype=torch.float64, device=device)
    current = {}
    handle = o_proj.register_forward_pre_hook(lambda module, args: current.update(z=args[0]))
    try:
        with torch.no_grad():
            for chunk in fit.split(batch_blocks):
                _attention_output(attn, inputs[chunk].to(device), kwargs)
                a = current["z"].reshape(-1, o_proj.weight.shape[1]).double()  # (N, H*hd)
                if has_bias:
                    a = torch.cat([a, a.new_ones(len(a), 1)], dim=1)
                gram += a.T @ a
                cross += a.T @ targets[chunk].to(device).reshape(len(a), -1).double()
    finally:
        handle.remove()
    ridge = 1e-6 * gram.diagonal().mean() * torch.eye(width, dtype=torch.float64, device=device)
    solution = torch.linalg.solve(gram + ridge, cross)  # (width, d)
    with torch.no_grad():
        o_proj.weight.copy_(solution[: o_proj.weight.shape[1]].T)
        if has_bias:
            o_proj.bias.copy_(solution[-1])


def _tensor_names(layout: Layout, index: int, attn, solved: dict | None = None) -> dict[str, torch.Tensor]:
    """The refined parameters under their checkpoint names: the attention's, and those the block stage
    solved (`solved`: names relative to the layer)."""
    layer = layout.layer_prefix.format(layer=index)
    prefix = layer + _attention_path(layout) + "."
    tensors = {prefix + name: p.detach() for name, p in attn.named_parameters()}
    tensors.update({layer + name: p for name, p in (solved or {}).items()})
    return tensors
