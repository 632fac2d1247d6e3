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
Memory: four (tokens, hidden) float32 buffers for the current layer (parent and converted hidden
states, the converted attention input, the target), on the device when they fit in `memory` bytes,
else memory-mapped files under $TMPDIR. The last 1/8 of the calibration blocks are held out: each
layer's relative output error is reported on fit and held-out tokens, before and after.

The fit (chosen by measurement, docs/refine.md): Adam on the normalised MSE
||attn(x) - t||^2 / mean ||t||^2 over random mini-batches of blocks, cosine-decayed learning rate,
then a closed-form least-squares solve of o_proj given the rest. A layer whose fit or held-out
error would rise is left as merged, so a model that is already exact stays exact and a layer that
overfits too few calibration tokens is not made worse.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mha2gqa.convert.options import REFINE_TOKENS_PER_HIDDEN, RefineOptions
from mha2gqa.errors import InputError
from mha2gqa.layouts import AttentionShape, Layout

HOLDOUT_FRACTION = 1 / 8
SEQ_LEN = 512
EXACT = 1e-10  # relative output error treated as exact
BUFFERS = ("parent", "converted", "inputs", "targets")


def check_refine(options: RefineOptions, calibration, config: dict | None = None, tokens: int | None = None) -> None:
    """Refuse, before anything is read or written, a refinement the flags cannot serve."""
    if calibration is None:
        raise InputError(
            "--refine needs calibration data to fit against: add --calibration DATA "
            "(a text file, a directory of them, or 'austen' for the embedded novels)"
        )
    options.check()
    tokens = getattr(calibration, "tokens", tokens)
    seq_len = block_length(config or {})
    if tokens is not None and tokens < 2 * seq_len:
        raise InputError(
            f"--refine needs at least 2 calibration blocks of {seq_len} tokens (got {tokens} tokens): "
            f"raise --calibration-tokens to {2 * seq_len} or more"
        )


def block_length(config) -> int:
    """Tokens per calibration block: 512, or the model's context when shorter (as calibration uses)."""
    context = (config.get if isinstance(config, dict) else lambda key: getattr(config, key, None))(
        "max_position_embeddings"
    )
    return min(SEQ_LEN, context or SEQ_LEN)


class ActivationBuffers:
    """One layer's (blocks, seq, width) float32 buffers: on `device` when they fit `memory` bytes,
    else memory-mapped files in a temporary directory under $TMPDIR (removed on close)."""

    def __init__(self, blocks: int, seq_len: int, width: int, memory: int, device: torch.device):
        shape = (blocks, seq_len, width)
        numel = blocks * seq_len * width
        self.bytes = len(BUFFERS) * numel * 4
        self.spill_dir = None if self.bytes <= memory else Path(tempfile.mkdtemp(prefix="mha2gqa-refine-"))
        self.data = {}
        for name in BUFFERS:
            if self.spill_dir is None:
                self.data[name] = torch.empty(shape, dtype=torch.float32, device=device)
            else:
                path = self.spill_dir / f"{name}.f32"
                with open(path, "wb") as f:
                    f.truncate(numel * 4)
                self.data[name] = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32).view(shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.data[name]

    def swap(self, first: str, second: str) -> None:
        self.data[first], self.data[second] = self.data[second], self.data[first]

    def close(self) -> None:
        self.data.clear()
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)


def calibration_token_ids(source: Path, calibration, tokens: int) -> torch.Tensor:
    """The calibration ids, read and tokenized exactly as calibration.calibrate reads them; `calibration`
    is the --calibration spec or CalibrationStats, whose record names its data and token count."""
    from transformers import AutoTokenizer

    from mha2gqa import textdata
    from mha2gqa.convert.calibration import CALIBRATION_PIECE_CHARS, calibration_ids

    if hasattr(calibration, "record"):
        calibration, tokens = calibration.record["data"], calibration.tokens
    texts = textdata.iter_texts(
        textdata.resolve("--calibration", calibration), piece_chars=CALIBRATION_PIECE_CHARS, end_with_blank_line=True
    )
    return calibration_ids(AutoTokenizer.from_pretrained(source), texts, tokens)


def refine_checkpoint(
    source: Path,
    converted: Path,
    layout: Layout,
    shape: AttentionShape,
    ids: torch.Tensor,
    options: RefineOptions,
    progress: bool = True,
    device: str | None = None,
) -> dict:
    """Refine the checkpoint in `converted` (written by the merge) in place, layer by layer, against
    the parent in `source`. Returns the JSON-able record: options, token counts and per-layer errors."""
    from mha2gqa.convert.calibration import load_source_model

    started, started_cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(options.seed)
    parent = load_source_model(source, device, progress=progress).requires_grad_(False)
    model = load_source_model(converted, device, progress=progress).requires_grad_(False)
    run_device = next(model.parameters()).device
    seq_len = block_length(model.config)
    blocks = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)  # (n, S): full blocks only
    wanted = options.tokens or REFINE_TOKENS_PER_HIDDEN * shape.hidden
    if wanted < blocks.numel():  # a subset spread over the whole text
        blocks = blocks[torch.linspace(0, len(blocks) - 1, max(2, wanted // seq_len)).round().long()]
    if len(blocks) < 2:
        raise InputError(
            f"--refine needs at least 2 calibration blocks of {seq_len} tokens, but the calibration data gave "
            f"{len(ids)} tokens: pass more text (at least {2 * seq_len} tokens), or raise --calibration-tokens "
            "if it set a lower limit"
        )
    held = max(1, round(len(blocks) * HOLDOUT_FRACTION))
    split = {"fit": torch.arange(len(blocks) - held), "heldout": torch.arange(len(blocks) - held, len(blocks))}
    buffers = ActivationBuffers(len(blocks), seq_len, shape.hidden, options.memory, run_device)
    generator = torch.Generator().manual_seed(options.seed)
    layers = []
    try:
        layer_kwargs = _first_hidden_states(parent, layout, shape.layers, blocks, buffers, options.batch_blocks)
        buffers["converted"].copy_(buffers["parent"])
        for index in range(shape.layers):
            kwargs = layer_kwargs[index]
            parent_layer, layer = (m.get_submodule(_layer_path(layout, index)) for m in (parent, model))
            attn_kwargs, before, power = _layer_targets(
                parent_layer, layer, layout, kwargs, buffers, options.batch_blocks
            )
            attn = layer.get_submodule(_attention_path(layout))
            fit_before, held_before = (_relative(before, power, split[part]) for part in ("fit", "heldout"))
            merged = {name: p.detach().clone() for name, p in attn.named_parameters()}
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
                    progress,
                )
            # The next converted states go into the inputs buffer (free once the fit is done), measuring
            # the refined layer's errors on the way; the buffers then swap roles.
            after = _advance(layer, layout, kwargs, buffers, options.batch_blocks)
            fit_after, held_after = (_relative(after, power, split[part]) for part in ("fit", "heldout"))
            # Kept only if better on the fit blocks (an exact merge stays exact) and on the held-out ones
            # (a layer that overfits too few calibration tokens is left as merged).
            if fitted and not (fit_after < fit_before and held_after < held_before):
                with torch.no_grad():
                    for name, p in attn.named_parameters():
                        p.copy_(merged[name])
                _advance(layer, layout, kwargs, buffers, options.batch_blocks)
                fit_after, held_after = fit_before, held_before
            buffers.swap("converted", "inputs")
            _write_in_place(converted, _tensor_names(layout, index, attn))
            report = {
                "fit_error_before": fit_before,
                "fit_error_after": fit_after,
                "heldout_error_before": held_before,
                "heldout_error_after": held_after,
            }
            layers.append({"layer": index, **report})
    finally:
        buffers.close()
    tokens = {name: len(idx) * seq_len for name, idx in split.items()}
    return {
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
    }


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


def _stop(*_):
    raise _StopForward


def _advance(layer, layout: Layout, kwargs: dict, buffers, batch_blocks: int) -> torch.Tensor:
    """buffers['converted'] through the (refined) layer into buffers['inputs']; returns the attention's
    squared error per block against buffers['targets'] on the way."""
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
                dest[start:end] = (
                    _call_layer(layer, source[start:end].to(device, dtype), kwargs).float().to(dest.device)
                )
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
    progress: bool = True,
) -> None:
    """Fit `attn`'s parameters so that attn(inputs) ~= targets on the blocks `fit`: Adam, then the
    closed-form o_proj. Runs in float32 whatever the checkpoint's dtype."""
    dtype = next(attn.parameters()).dtype
    attn.float()
    _adam(attn, kwargs, inputs, targets, fit, options, generator, index, progress)
    if options.solve_output:
        _solve_output(attn, layout, kwargs, inputs, targets, fit, options.batch_blocks)
    attn.to(dtype)


def _adam(
    attn, kwargs, inputs, targets, fit: torch.Tensor, options: RefineOptions, generator, index: int, progress: bool
) -> None:
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
    bar = tqdm(range(options.steps), desc=f"refine layer {index}", unit="step", disable=not progress, leave=False)
    order = torch.empty(0, dtype=torch.long)
    try:
        for _ in bar:
            if len(order) < min(options.batch_blocks, len(fit)):  # epochs of a seeded permutation
                order = torch.cat([order, fit[torch.randperm(len(fit), generator=generator)]])
            chunk, order = order[: options.batch_blocks], order[options.batch_blocks :]
            x, t = inputs[chunk].to(device), targets[chunk].to(device)
            loss = (_attention_output(attn, x, kwargs) - t).pow(2).sum(-1).mean() / power
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.set_postfix(error=f"{loss.item():.4f}", refresh=False)
    finally:
        bar.close()
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


def _tensor_names(layout: Layout, index: int, attn) -> dict[str, torch.Tensor]:
    """The refined attention parameters under their checkpoint names."""
    prefix = layout.layer_prefix.format(layer=index) + _attention_path(layout) + "."
    return {prefix + name: p.detach() for name, p in attn.named_parameters()}


def _write_in_place(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite tensors of a safetensors checkpoint in place: same names, shapes and dtypes, so only
    their bytes change and no shard is rewritten."""
    from mha2gqa.checkpoint import DTYPES, SafetensorsCheckpoint

    infos = SafetensorsCheckpoint(model_dir).tensors
    for name, tensor in tensors.items():
        if name not in infos:
            raise InputError(f"refine: {name} is not in {model_dir}: the checkpoint's names do not match its model")
        info = infos[name]
        data = tensor.to("cpu", DTYPES[info.dtype]).contiguous().reshape(-1).view(torch.uint8)
        if tuple(tensor.shape) != info.shape or data.numel() != info.nbytes:
            raise InputError(f"refine: {name} has shape {tuple(tensor.shape)}, the checkpoint {info.shape}")
        with open(info.file, "r+b") as f:
            f.seek(info.start)
            f.write(data.numpy().tobytes())
