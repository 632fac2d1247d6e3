"""The converted model that `--refine` fits, built from the loaded parent without writing a checkpoint, and
the paths of a layer and its attention module inside it."""

from __future__ import annotations

from mha2gqa.architecture.layouts import AttentionShape, Layout
from mha2gqa.convert.options import OUT_DTYPES
from mha2gqa.runtime.errors import InputError


def converted_model(parent, layout: Layout, shape: AttentionShape, config: dict, merged: dict, out_dtype=None):
    """The converted model as loading the written checkpoint would give it, without writing it: the
    parent's classes built for `config` on the meta device, then every tensor assigned: the merged
    attention (in the parent's dtype), the rest the parent's own (shared: refine never changes them) or,
    with --dtype, their cast and back (what the checkpoint stores). Attention tensors are copies, since
    refine fits them in place."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from mha2gqa.files.checkpoint import DTYPES

    cast = DTYPES[OUT_DTYPES[out_dtype]] if out_dtype else None
    attention = tuple(layout.layer_prefix.format(layer=i) + attention_path(layout) + "." for i in range(shape.layers))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            _config_class(parent, config).from_dict(config),
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


def _config_class(parent, config: dict):
    """The converted config's class: the parent's, or (per-layer kv heads) mha2gqa's Nemotron-NAS one."""
    from mha2gqa.nemotron_nas.blocks import MODEL_TYPE

    if config.get("model_type") != MODEL_TYPE:
        return type(parent.config)
    from mha2gqa.nemotron_nas.modeling import NemotronNasConfig, register

    register()
    return NemotronNasConfig


def layer_path(layout: Layout, index: int) -> str:
    return layout.layer_prefix.format(layer=index).rstrip(".")


def decoder_layers(model, layout: Layout, count: int) -> list:
    """The model's first `count` decoder layers, found by the layout's layer paths."""
    return [model.get_submodule(layer_path(layout, index)) for index in range(count)]


def attention_path(layout: Layout) -> str:
    """The attention module relative to the layer: the parent of o_proj (self_attn in every layout)."""
    return layout.o.rsplit(".", 1)[0]
