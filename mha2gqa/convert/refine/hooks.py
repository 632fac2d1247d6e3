"""Running the two models one layer at a time, and the hooks that read what `--refine` needs on the way:
each layer's keyword arguments, the parent's attention outputs (the targets), the converted attention's
inputs, and the per-block squared error of the converted attention against the targets. Activations go to
and come from the layer's ActivationBuffers (buffers.py); every layer is called as the model calls it."""

from __future__ import annotations

import torch

from mha2gqa.architecture.layouts import Layout
from mha2gqa.convert.refine.model import attention_path, decoder_layers


class StopForward(Exception):
    """Raised by a hook once it has what it needs, to skip the rest of a forward pass."""


def stop(*_):
    raise StopForward


def output_of(out) -> torch.Tensor:
    """The hidden states of a module's output: transformers' layers and attentions return a tuple."""
    return out[0] if isinstance(out, tuple) else out


def call_layer(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return output_of(layer(hidden, **kwargs))


def attention_output(attn, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return output_of(attn(hidden_states=x, **kwargs))


def batch_one(value, batch: int):
    """Captured call arguments with any per-sequence batch dim cut to 1: every block has the same
    positions and no padding, so masks and rotary tables broadcast to any batch."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch and batch > 1:
        return value[:1]
    if isinstance(value, tuple):
        return tuple(batch_one(v, batch) for v in value)
    return value


def capture_kwargs(kwargs: dict, batch: int) -> dict:
    return {key: batch_one(value, batch) for key, value in kwargs.items() if key != "hidden_states"}


def first_hidden_states(parent, layout: Layout, n_layers: int, blocks: torch.Tensor, buffers, batch_blocks: int):
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
        raise StopForward

    def keep_kwargs(index):
        def hook(module, args, kwargs):
            layer_kwargs[index] = capture_kwargs(kwargs, (args[0] if args else kwargs["hidden_states"]).shape[0])

        return hook

    layers = decoder_layers(parent, layout, n_layers)
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
                except StopForward:
                    pass
        finally:
            handle.remove()
    return layer_kwargs


def block_errors(out, targets: torch.Tensor, start: int, errors: torch.Tensor) -> None:
    """Per-block squared error of an attention output against the targets, into errors[start:...]."""
    out = output_of(out)
    t = targets[start : start + len(out)].to(out.device)
    errors[start : start + len(out)] = (out.float() - t).double().pow(2).sum((1, 2)).cpu()


def layer_targets(parent_layer, layer, layout: Layout, kwargs: dict, buffers, batch_blocks: int):
    """Advance the parent's hidden states through its layer, keeping its attention output as the
    target; run the converted layer on its own hidden states up to the end of its attention, keeping
    its attention input and the merged attention's error. Returns the keyword arguments the layer passes to its attention module,
    and per block the squared error (blocks,) and the target power (blocks,), float64."""
    path = attention_path(layout)
    parent_attn, attn = parent_layer.get_submodule(path), layer.get_submodule(path)
    cursor = {"start": 0}
    attn_kwargs: dict = {}
    blocks = len(buffers["parent"])
    errors, power = torch.zeros(blocks, dtype=torch.float64), torch.zeros(blocks, dtype=torch.float64)
    device = next(layer.parameters()).device

    def keep_target(module, args, kwargs, output):
        start = cursor["start"]
        out = output_of(output)
        buffers["targets"][start : start + len(out)] = out.float().to(buffers["targets"].device)
        power[start : start + len(out)] = out.double().pow(2).sum((1, 2)).cpu()

    def keep_input(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        start = cursor["start"]
        buffers["inputs"][start : start + len(hidden)] = hidden.float().to(buffers["inputs"].device)
        if not attn_kwargs:
            attn_kwargs.update(capture_kwargs(kwargs, len(hidden)))

    handles = [
        parent_attn.register_forward_hook(keep_target, with_kwargs=True),
        attn.register_forward_pre_hook(keep_input, with_kwargs=True),
        attn.register_forward_hook(lambda m, a, out: block_errors(out, buffers["targets"], cursor["start"], errors)),
    ]
    handles.append(attn.register_forward_hook(stop))  # the converted layer's MLP is not needed here
    dtype = next(layer.parameters()).dtype
    try:
        with torch.no_grad():
            for start in range(0, blocks, batch_blocks):
                cursor["start"] = start
                end = start + batch_blocks
                hidden = buffers["parent"][start:end].to(device, dtype)
                buffers["parent"][start:end] = (
                    call_layer(parent_layer, hidden, kwargs).float().to(buffers["parent"].device)
                )
                try:
                    call_layer(layer, buffers["converted"][start:end].to(device, dtype), kwargs)
                except StopForward:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return attn_kwargs, errors, power


def advance(layer, layout: Layout, kwargs: dict, buffers, batch_blocks: int) -> torch.Tensor:
    """buffers['converted'] through the (refined) layer into buffers['inputs']; returns the attention's
    squared error per block against buffers['targets'] on the way."""
    source, dest = buffers["converted"], buffers["inputs"]
    device, dtype = next(layer.parameters()).device, next(layer.parameters()).dtype
    errors = torch.zeros(len(source), dtype=torch.float64)
    cursor = {"start": 0}
    handle = layer.get_submodule(attention_path(layout)).register_forward_hook(
        lambda m, a, out: block_errors(out, buffers["targets"], cursor["start"], errors)
    )
    try:
        with torch.no_grad():
            for start in range(0, len(source), batch_blocks):
                cursor["start"] = start
                end = start + batch_blocks
                out = call_layer(layer, source[start:end].to(device, dtype), kwargs)
                dest[start:end] = out.float().to(dest.device)
    finally:
        handle.remove()
    return errors
