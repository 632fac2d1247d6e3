"""The layout of a model_type that has no entry in layouts.LAYOUTS, derived from the model itself.

transformers builds the model class from the config on the meta device (no memory, no weights),
twice: once as configured and once with another num_key_value_heads (half of it, or 1, or 2 for a
model that already has one; some classes refuse 1). Every decoder layer must own an
attention module with q_proj/k_proj/v_proj and an output projection, and the only parameters whose
shapes follow num_key_value_heads must be those k/v projections (and a key norm over all kv heads).
Anything else (MLA-style low-rank K/V, linear-attention or state-space layers in a hybrid, layers
with their own kv-head counts, a class that ignores num_key_value_heads) is refused in one line that
names what did not fit. Known special cases stay explicit entries in LAYOUTS, which always win.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import tempfile
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from mha2gqa.architecture.layout_spec import Layout
from mha2gqa.files import jsontext
from mha2gqa.runtime.errors import InputError, first_line

OUTPUT_NAMES = ("o_proj", "out_proj", "dense")
_LAYER = re.compile(r"^(?P<prefix>.*\.)(?P<index>\d+)\.(?P<attention>[^.]+(?:\.[^.]+)*)$")


@dataclass(frozen=True)
class GenericArchitecture:
    layout: Layout | None  # None from config_counts, which reads counts only
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int


def config_counts(config: dict) -> GenericArchitecture:
    """Layer, head and size counts read through transformers' config class (its defaults and
    aliases, e.g. gpt2's n_head), without building the model; kv heads default to the heads."""
    built = _config_object(config)
    heads = _config_value(built, "num_attention_heads")
    hidden = _config_value(built, "hidden_size")
    head_dim = _config_value(built, "head_dim") or hidden // heads
    return GenericArchitecture(
        None,
        _config_value(built, "num_hidden_layers"),
        heads,
        _config_value(built, "num_key_value_heads") or heads,
        head_dim,
        hidden,
    )


def generic_architecture(config: dict) -> GenericArchitecture:
    """The derived layout and geometry of `config`, or InputError naming what did not fit."""
    return _derive(jsontext.shown(config, sort_keys=True))


@lru_cache(maxsize=8)
def _derive(config_json: str) -> GenericArchitecture:
    config = json.loads(config_json)
    model_type = config.get("model_type")
    fail = _refusal_prefix(model_type)
    if isinstance(config.get("text_config"), dict):
        raise InputError(
            f"{fail}: it is a composite model (vision/audio + text) whose decoder is configured in "
            "text_config, which the converter does not rewrite"
        )
    source = _build(config, model_type, kv_heads=None)
    layer_count = _config_value(source.config, "num_hidden_layers")
    heads = _config_value(source.config, "num_attention_heads")
    kv_heads = _config_value(source.config, "num_key_value_heads")
    if not (layer_count and heads and kv_heads):
        raise InputError(
            f"{fail}: its config has no num_hidden_layers/num_attention_heads/num_key_value_heads, "
            "so its attention cannot be grouped"
        )
    modules = dict(source.named_modules())
    attention = {name: module for name, module in modules.items() if _is_attention(module)}
    if not attention:
        raise InputError(
            f"{fail}: no module owns q_proj, k_proj, v_proj and an output projection "
            f"({', '.join(OUTPUT_NAMES)}), so no layer has attention with separate k/v heads"
            f"{_low_rank_hint(modules)}"
        )
    matches = [_LAYER.match(name) for name in attention]
    places = {(m["prefix"], m["attention"]) for m in matches if m}
    if len(places) != 1 or len(matches) != len([m for m in matches if m]):
        raise InputError(
            f"{fail}: attention modules sit at different places ({_some(sorted(attention))}); "
            "only one attention module per decoder layer is supported"
        )
    ((prefix, relative),) = places
    indices = sorted(int(m["index"]) for m in matches)
    missing = sorted(set(range(layer_count)) - set(indices))
    if missing:
        raise InputError(
            f"{fail}: decoder layers {_some(missing)} of {layer_count} have no q/k/v/o attention (linear "
            "attention or state-space layers in a hybrid), so num_key_value_heads does not describe them"
        )
    probe = kv_heads // 2 if kv_heads % 2 == 0 else (1 if kv_heads > 1 else 2)
    target = _build(config, model_type, kv_heads=probe)
    return _validate_shapes(source, target, probe, prefix, relative, layer_count, heads, kv_heads, fail)


def validate_target(config: dict, groups: int) -> None:
    """Refuse a kv-head count the model class cannot be built with (diffllama needs an even count)
    or builds with other k_proj shapes than the conversion writes."""
    derived = generic_architecture(config)
    target = _build(
        config,
        config.get("model_type"),
        kv_heads=groups,
        fail=f"--groups {groups}: model_type {config.get('model_type')!r} cannot have that many kv heads",
    )
    name = derived.layout.layer_prefix.format(layer=0) + derived.layout.k + ".weight"
    rows = dict(target.named_parameters())[name].shape[0]
    if rows != groups * derived.head_dim:
        raise InputError(
            f"--groups {groups}: transformers builds {config.get('model_type')!r} with {rows} k_proj rows "
            f"for num_key_value_heads={groups}, not {groups} x head_dim {derived.head_dim}"
        )


def _validate_shapes(source, target, probe, prefix, relative, layer_count, heads, kv_heads, fail):
    """Only k/v (and a key norm over all kv heads) may follow num_key_value_heads, in every layer alike."""
    before = {name: tuple(p.shape) for name, p in source.named_parameters()}
    after = {name: tuple(p.shape) for name, p in target.named_parameters()}
    attention_prefix = f"{prefix}0.{relative}."
    first = source.get_submodule(f"{prefix}0.{relative}")
    k_rows, head_dim = _head_dim(source, first, heads, kv_heads, fail)
    k_norm_rows = _key_norm(before, after, prefix, relative, probe, kv_heads, k_rows, fail)
    for layer in range(layer_count):
        name = f"{prefix}{layer}.{relative}.k_proj.weight"
        if after.get(name, (None,))[0] != probe * head_dim:
            raise InputError(
                f"{fail}: {name} does not have {probe} x head_dim rows with num_key_value_heads="
                f"{probe}: the model class does not read num_key_value_heads for every layer"
            )
    extras = sorted(
        {name[len(attention_prefix) :].rsplit(".", 1)[0] for name in before if name.startswith(attention_prefix)}
        - {"q_proj", "k_proj", "v_proj", _output_name(first)}
    )
    layout = Layout(
        q=f"{relative}.q_proj",
        k=f"{relative}.k_proj",
        v=f"{relative}.v_proj",
        o=f"{relative}.{_output_name(first)}",
        k_norm_rows=k_norm_rows,
        layer_prefix=prefix + "{layer}.",
        calibrated_barrier=_key_path_refusal(first, extras),
        grouping_barrier=(
            f"its attention has {', '.join(extras)} besides q/k/v/o, which a query-head permutation would leave behind"
        )
        if extras
        else None,
    )
    hidden = _config_value(source.config, "hidden_size") or first.q_proj.weight.shape[1]
    return GenericArchitecture(layout, layer_count, heads, kv_heads, head_dim, hidden)


def _head_dim(source, first, heads: int, kv_heads: int, fail: str) -> tuple[int, int]:
    """(k_proj rows, head_dim) of layer 0's attention `first`, refused unless k and v, q and the output
    projection all agree with the config's head counts."""
    k_rows, v_rows = first.k_proj.weight.shape[0], first.v_proj.weight.shape[0]
    if k_rows % kv_heads or k_rows != v_rows:
        raise InputError(
            f"{fail}: layer 0's k_proj has {k_rows} rows and v_proj {v_rows}, not the same multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    head_dim = k_rows // kv_heads
    configured = _config_value(source.config, "head_dim")
    if configured and configured != head_dim:
        raise InputError(f"{fail}: k_proj rows / num_key_value_heads = {head_dim} but config head_dim={configured}")
    q_rows, o_columns = first.q_proj.weight.shape[0], _output(first).weight.shape[1]
    if q_rows != heads * head_dim or o_columns != heads * head_dim:
        raise InputError(
            f"{fail}: q_proj has {q_rows} rows and the output projection {o_columns} columns, not "
            f"num_attention_heads x head_dim = {heads * head_dim} (a gated or differently shaped query)"
        )
    return k_rows, head_dim


def _key_norm(before: dict, after: dict, prefix, relative, probe: int, kv_heads: int, k_rows: int, fail: str):
    """The key norm over all kv heads (olmo2's k_norm) among the parameters whose shape follows
    num_key_value_heads (before: the source's shapes, after: those with `probe` kv heads), or None;
    refused when anything but k/v and that norm follows it."""
    k_norm_rows = None
    for name, shape in before.items():
        if after.get(name) == shape:
            continue
        match = re.match(re.escape(prefix) + r"\d+\.(.*)$", name)
        role = match[1] if match else name
        scaled = after.get(name) == (shape[0] // kv_heads * probe, *shape[1:]) and shape[0] % kv_heads == 0
        if role.startswith(f"{relative}.k_proj.") or role.startswith(f"{relative}.v_proj."):
            if not scaled or shape[0] != k_rows:
                raise InputError(
                    f"{fail}: {name} has shape {list(shape)}; layer 0 has {k_rows} rows (layers with "
                    "their own kv-head counts or head sizes, e.g. sliding/global, are not supported)"
                )
        elif role.startswith(f"{relative}.") and "norm" in role and scaled and shape == (k_rows,):
            norm = role.rsplit(".", 1)[0]
            if k_norm_rows not in (None, norm) or not norm.split(".")[-1].startswith("k"):
                raise InputError(f"{fail}: {name} {list(shape)} follows num_key_value_heads but is not a key norm")
            k_norm_rows = norm
        else:
            raise InputError(
                f"{fail}: {name} {list(shape)} changes shape with num_key_value_heads but is not a "
                "k_proj/v_proj or key norm, so the converter cannot rewrite it"
            )
    return k_norm_rows


def _key_path_refusal(attention, extras: list[str]) -> str | None:
    """Why a per-head key map folded into q_proj may not be exact: a parameterised module (a norm, a
    gate) inside the attention, or a RoPE that is not transformers' standard rotate_half."""
    if extras:
        return (
            f"its attention has {', '.join(extras)} besides q/k/v/o (a norm or gate on the key path is not ruled out)"
        )
    module = inspect.getmodule(type(attention))
    forward = inspect.getsource(type(attention).forward)
    if "apply_rotary_pos_emb(" not in forward:
        return "its attention does not apply transformers' apply_rotary_pos_emb, so its RoPE convention is unknown"
    from transformers.models.llama import modeling_llama as reference

    for function in ("rotate_half", "apply_rotary_pos_emb"):
        ours, standard = getattr(module, function, None), getattr(reference, function)
        if ours is None or (ours is not standard and not _same_body(module.__name__, reference.__name__, function)):
            return f"its {function} differs from transformers' standard (llama) one, so its RoPE convention is unknown"
    return None


def _same_body(module_name: str, reference_name: str, function: str) -> bool:
    ours = _body(module_name, function)
    return ours is not None and ours == _body(reference_name, function)


@cache
def _body(module_name: str, function: str) -> str | None:
    """The statements of the module's own top-level `def function`, as an AST dump without the docstring:
    two copies that differ only in name, signature, comments or layout compare equal. Read from the
    source file, not the object, because a decorator may replace the function by another object
    (transformers >= 5.25 wraps apply_rotary_pos_emb in a kernels `Func` module when kernels is installed)."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            return "\n".join(ast.dump(statement) for statement in body)
    return None


def _build(config: dict, model_type, kv_heads: int | None, fail: str | None = None):
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    fail = fail or _refusal_prefix(model_type)
    if model_type not in CONFIG_MAPPING or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise InputError(
            f"{fail}: the installed transformers has no causal-LM class for it (upgrade transformers, or "
            "check config.json's model_type)"
        )
    try:
        built = _config_object(config if kv_heads is None else dict(config, num_key_value_heads=kv_heads))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(built)
    except Exception as err:  # a class that cannot be built from this config is a refusal, not a crash
        raise InputError(
            f"{fail}: transformers could not build it from this config ({type(err).__name__}: {first_line(err, 160)})"
        ) from err


def _config_object(config: dict):
    """The transformers config of a config.json dict, read the way from_pretrained reads the file
    (it decodes special floats such as Infinity, which a plain from_dict rejects)."""
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="mha2gqa-config-") as folder:
        (Path(folder) / "config.json").write_text(jsontext.model_config(config))
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def _config_value(config, name: str):
    """An int attribute of a transformers config, or None (absent, per-layer, or not an int)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # transformers raises for attributes that vary per layer
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_attention(module) -> bool:
    children = dict(module.named_children())
    linear = all(hasattr(children.get(name), "weight") for name in ("q_proj", "k_proj", "v_proj"))
    return linear and _output_name(module) is not None


def _output_name(module) -> str | None:
    return next((name for name in OUTPUT_NAMES if hasattr(getattr(module, name, None), "weight")), None)


def _output(module):
    return getattr(module, _output_name(module))


def _low_rank_hint(modules: dict) -> str:
    names = {name.rsplit(".", 1)[-1] for name in modules}
    low_rank = sorted(n for n in names if "kv_a" in n or "kv_b" in n or "lora" in n)
    return f"; it has {', '.join(low_rank)} instead (low-rank K/V as in MLA)" if low_rank else ""


def _some(items: list, shown: int = 6) -> str:
    """The first few items and how many more: a refusal stays one readable line."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(map(str, items[:shown])) + more


def _refusal_prefix(model_type) -> str:
    return f"model_type {model_type!r} has no explicit layout and the generic one does not fit"
