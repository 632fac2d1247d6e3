"""Per-architecture attention layouts, as data.

A layout names the attention tensors of one decoder layer, relative to the layer prefix, says how
each kv-carrying tensor is laid out, and records the norms on the query/key path that limit what a
merge may fold into q_proj (see convert/rope.py for why). Adding a model family is one entry in
LAYOUTS. The layout is chosen from config.json's `model_type`, never from a model's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.architecture.generic_layout import config_counts, generic_architecture
from mha2gqa.architecture.generic_layout import validate_target as validate_generic_target
from mha2gqa.architecture.layout_spec import Layout
from mha2gqa.files import jsontext
from mha2gqa.files.reading import read_json
from mha2gqa.nemotron_nas.blocks import MODEL_TYPE as NEMOTRON_NAS
from mha2gqa.nemotron_nas.blocks import layer_kv_heads, validate_blocks
from mha2gqa.runtime.errors import InputError

_STANDARD = Layout()
LAYOUTS: dict[str, Layout] = {
    "llama": _STANDARD,
    "mistral": _STANDARD,
    "gemma": _STANDARD,
    "gemma2": _STANDARD,
    "olmo": _STANDARD,
    "granite": _STANDARD,
    "qwen2": _STANDARD,
    "qwen3": Layout(
        shared_norms=("self_attn.q_norm", "self_attn.k_norm"),
        pre_rope_norm="its q_norm/k_norm (one [head_dim] RMSNorm shared by all heads) sit between q/k_proj and RoPE",
    ),
    "olmo2": Layout(
        k_norm_rows="self_attn.k_norm",
        pre_rope_norm="its q_norm/k_norm normalise all heads together between q/k_proj and RoPE",
        per_query_head_norm="its q_norm has one slice per query head",
    ),
    "stablelm": Layout(
        k_norm_per_head="self_attn.k_layernorm.norms.{head}",
        norms_when="qk_layernorm",
        pre_rope_norm="its qk_layernorm sits between q/k_proj and RoPE",
        per_query_head_norm="its q_layernorm has one norm per query head",
    ),
    "phi": Layout(
        o="self_attn.dense", norms_when="qk_layernorm", pre_rope_norm="its qk_layernorm sits between q/k_proj and RoPE"
    ),
    "phi3": Layout(qkv="self_attn.qkv_proj"),
    # Llama's tensors with each layer's own kv heads (nemotron_nas/): eval and uptrain read it; convert refuses it
    NEMOTRON_NAS: _STANDARD,
}

# Families whose grouped form is another model_type. gpt_bigcode is gpt2 with multi_query (one kv
# head) and nn.Linear where gpt2 has Conv1D; it offers no other kv-head count.
_CONV1D_QO = "its q and o projections are Conv1D weights that the merge does not rewrite"
RETARGETED: dict[str, Layout] = {
    "gpt2": Layout(
        o="attn.c_proj",
        qkv_columns="attn.c_attn",
        transposed=("attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
        layer_prefix="transformer.h.{layer}.",
        target="gpt_bigcode",
        calibrated_barrier=_CONV1D_QO,
        grouping_barrier=_CONV1D_QO,
        refine_barrier="the converted model is another type (gpt_bigcode) than the parent it would be fitted to",
    ),
}

# Families we know and refuse, with the reason the user sees.
REFUSED: dict[str, str] = {
    "falcon": "its transformers cache stores K/V broadcast to every query head, so GQA saves no memory",
    "gpt_bigcode": "its multi-query form is the target of gpt2 conversion (convert the gpt2 parent instead); "
    "its multi-head c_attn interleaves q/k/v per head, which is not implemented",
}
for _name in ("gpt_neox", "opt", "gptj", "bloom", "t5", "mt5", "bart"):
    REFUSED[_name] = "transformers has no grouped-query attention for it"


@dataclass(frozen=True)
class AttentionShape:
    """The attention geometry of a decoder, read from its config."""

    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    dtype: str = "float32"
    # Each layer's kv heads where they differ (a Nemotron-NAS model; kv_heads is then their largest); () when
    # every layer has kv_heads.
    layer_kv_heads: tuple[int, ...] = ()

    def valid_groups(self) -> list[int]:
        """Target kv-head counts reachable by pooling contiguous groups (divisors of kv_heads)."""
        return [g for g in range(1, self.kv_heads + 1) if self.kv_heads % g == 0]

    def kv_bytes_per_token(self, kv_heads: int | None = None, dtype_bytes: int | None = None) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * bytes (with layer_kv_heads and no
        `kv_heads` given, the sum of each layer's)."""
        size = dtype_bytes or DTYPE_BYTES[self.dtype]
        if kv_heads is None and self.layer_kv_heads:
            return sum(kv_cache_bytes(1, n_kv, self.head_dim, size) for n_kv in self.layer_kv_heads)
        n_kv = self.kv_heads if kv_heads is None else kv_heads
        return kv_cache_bytes(self.layers, n_kv, self.head_dim, size)


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1}


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def head_counts(config: dict) -> tuple:
    """(heads, kv_heads, head_dim) as a config.json dict states them, the one reading of them: kv heads
    default to the heads, head_dim to hidden_size // heads (read it when present: gemma's differs).
    None where the config lacks what a value comes from; read_config has checked the values' types."""
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (hidden // heads if heads and hidden else None)
    return heads, kv_heads, head_dim


def config_vocab(config: dict) -> int:
    """The config's vocab_size, or 0 where it has none (a size estimate then leaves the vocabulary out)."""
    vocab = config.get("vocab_size")
    return vocab if isinstance(vocab, int) else 0


def config_dtype(config: dict) -> str:
    """The weights' dtype a config.json names (`dtype`, formerly `torch_dtype`), float32 when it names none."""
    return str(config.get("dtype") or config.get("torch_dtype") or "float32").replace("torch.", "")


# Counts the attention geometry is computed from: positive integers when present; the first three
# are required for an explicit layout (the generic one reads them through transformers' config class).
_REQUIRED_COUNTS = ("num_attention_heads", "hidden_size", "num_hidden_layers")
_OPTIONAL_COUNTS = ("num_key_value_heads", "head_dim")  # null or absent: defaults (heads, hidden // heads)


# Sizes a config.json states that size loops and allocations (layers built, heads enumerated, a model
# made on the meta device). Each kind is bounded by what the weights can hold: a layer has a tensor of
# its own, a head at least one row, an expert an index or a row; without weights, by CEILINGS, which no
# real decoder is near (the largest today: 128 layers, 128 heads, hidden 18432, 256 experts).
_SIZE_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "heads": ("num_attention_heads", "num_key_value_heads", "n_head", "num_kv_heads", "multi_query_group_num"),
    "width": ("hidden_size", "head_dim", "n_embd", "d_model", "intermediate_size", "n_inner", "ffn_dim"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts"),
}
CEILINGS = {"layers": 10_000, "heads": 100_000, "width": 10_000_000, "experts": 100_000}
_INDEXED = {
    "layers": re.compile(r"\.(?:layers|h|blocks|block|decoder_layers)\.(\d+)\."),
    "experts": re.compile(r"\.experts\.(\d+)\."),
}


def validate_sizes(config: dict, shapes: dict[str, tuple] | None, path) -> None:
    """Refuse a config whose sizes its weights cannot hold (`shapes`: tensor name -> shape, from the
    safetensors headers; None when there are no weights: then the CEILINGS). The one check, made before
    anything loops or allocates by those sizes (10^9 layers hung convert and inspect)."""
    bounds, indexed = dict(CEILINGS), set()
    if shapes:
        widest = max((max(shape, default=1) for shape in shapes.values()), default=1)
        bounds = {"layers": len(shapes), "heads": widest, "width": widest, "experts": max(len(shapes), widest)}
        for kind, pattern in _INDEXED.items():
            indices = [int(m.group(1)) for name in shapes if (m := pattern.search("." + name))]
            if indices:
                bounds[kind] = max(indices) + 1
                indexed.add(kind)
    for kind, keys in _SIZE_KEYS.items():
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > bounds[kind]:
                held = "the weights hold" if shapes else "mha2gqa accepts"
                missing = ""
                if kind == "layers" and shapes and "layers" in indexed:
                    shown = ", ".join(str(n) for n in range(bounds[kind], min(value, bounds[kind] + 8)))
                    missing = f"; no tensors for layer(s) {shown}{', ...' if value > bounds[kind] + 8 else ''}"
                raise InputError(
                    f"{path} has {key}={value:,}, more than {held} ({bounds[kind]:,} at most{missing}): "
                    "fix it or use the model's own config.json"
                )


def read_config(model_dir: str | Path, shapes: dict[str, tuple] | None = None) -> dict:
    """config.json as a dict, with the counts that attention shapes come from checked, and its sizes
    against the weights (`shapes`, see validate_sizes)."""
    path = Path(model_dir) / "config.json"
    config = read_json(path, "fix or re-save it", root=Path(model_dir))
    if not isinstance(config, dict):
        raise InputError(f"{path} is a JSON {type(config).__name__}, not an object of settings: fix or re-save it")
    if not isinstance(config.get("model_type"), str):
        raise InputError(
            f"{path} has model_type={jsontext.shown(config.get('model_type'))}: it must name the "
            'architecture (e.g. "llama"); use the model\'s own config.json'
        )
    for key in _REQUIRED_COUNTS + _OPTIONAL_COUNTS:
        value = config.get(key)
        if value is None and (key in _OPTIONAL_COUNTS or config.get("model_type") not in LAYOUTS):
            continue
        if value is None:
            raise InputError(f"{path} has no {key}: add it (a positive integer) or use the model's own config.json")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(
                f"{path} has {key}={jsontext.shown(value)}: it must be a positive integer; fix config.json"
            )
    validate_sizes(config, shapes, path)
    return config


def layout_for(config: dict) -> Layout:
    """The explicit entry for config's model_type; else the layout derived from the model class
    (generic_layout.py), or InputError saying why neither fits."""
    model_type = config.get("model_type")
    if model_type in LAYOUTS:
        return LAYOUTS[model_type]
    if model_type in RETARGETED:
        return RETARGETED[model_type]
    if model_type in REFUSED:
        supported = ", ".join(sorted(LAYOUTS))
        raise InputError(f"model_type {model_type!r} is not supported: {REFUSED[model_type]} (supported: {supported})")
    return generic_architecture(config).layout


def attention_shape(config: dict) -> AttentionShape:
    """Heads, kv heads and head_dim of a config, checked: transformers itself does not check them."""
    layout_for(config)
    per_layer = ()
    if config.get("model_type") == NEMOTRON_NAS and isinstance(config.get("block_configs"), list):
        heads, _, head_dim = head_counts(config)
        validate_blocks(config, "config.json")
        per_layer = tuple(layer_kv_heads(config))
        kv_heads, hidden, layers = max(per_layer), config["hidden_size"], config["num_hidden_layers"]
    elif config.get("model_type") in LAYOUTS:
        heads, kv_heads, head_dim = head_counts(config)
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    else:  # read through transformers' config class (defaults, aliases: gpt2's n_head), checked against the model
        derived = config_counts(config) if config.get("model_type") in RETARGETED else generic_architecture(config)
        heads, kv_heads, hidden, head_dim = derived.heads, derived.kv_heads, derived.hidden, derived.head_dim
        layers = derived.layers
    if heads % kv_heads:
        raise InputError(
            f"config has num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads}: "
            "the source checkpoint is inconsistent"
        )
    dtype = config_dtype(config)
    return AttentionShape(
        model_type=config["model_type"],
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        dtype=dtype if dtype in DTYPE_BYTES else "float32",
        layer_kv_heads=per_layer,
    )


def target_groups(shape: AttentionShape) -> list[int]:
    """The kv-head counts a conversion of `shape` may target: the proper divisors of its kv heads."""
    return [g for g in shape.valid_groups() if g != shape.kv_heads]


def validate_groups(shape: AttentionShape, groups: int) -> None:
    """Refuse a target kv-head count that is not a proper divisor of the source's kv heads."""
    listed = ", ".join(map(str, target_groups(shape))) or "none: it already has a single kv head"
    target = RETARGETED[shape.model_type].target if shape.model_type in RETARGETED else None
    if target and groups != 1:
        raise InputError(
            f"--groups {groups}: model_type {shape.model_type!r} converts to {target!r}, whose only "
            "grouped form is multi-query attention; use --groups 1"
        )
    if groups == shape.kv_heads:
        raise InputError(
            f"--groups {groups} equals the source's num_key_value_heads={shape.kv_heads}: nothing to convert "
            f"(valid: {listed})"
        )
    if groups < 1 or shape.kv_heads % groups:
        raise InputError(f"--groups {groups} must divide num_key_value_heads={shape.kv_heads} (valid: {listed})")


def validate_target(config: dict, groups: int, flag: str = "--groups") -> None:
    """A source convert reads; for a type on the generic layout, the model class must build with `groups` kv
    heads. `flag`: the one that asked for the counts, named in the refusal."""
    model_type = config.get("model_type")
    if model_type == NEMOTRON_NAS:
        raise InputError(
            f"{flag}: SRC is a Nemotron-NAS checkpoint (per-layer kv heads), and convert reads models whose layers "
            "share one kv-head count: convert its parent instead (with --kv-heads-per-layer or --kv-budget)"
        )
    if model_type not in LAYOUTS and model_type not in RETARGETED:
        validate_generic_target(config, groups)


def converted_config(config: dict, groups: int) -> dict:
    """config.json of the converted model: the source's with `groups` kv heads, or, for a retargeted
    type, the target type's config (gpt2 -> gpt_bigcode with multi_query)."""
    layout = layout_for(config)
    if layout.target != "gpt_bigcode":
        return dict(config, num_key_value_heads=groups)
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise InputError(
            "config.json has scale_attn_by_inverse_layer_idx=true, which gpt_bigcode does not "
            "implement: the converted model would not match its parent"
        )
    from transformers import GPTBigCodeConfig

    # gpt2 keys gpt_bigcode also reads (sizes, activation, dropouts, eps, scale_attn_weights, token ids).
    shared = set(GPTBigCodeConfig().to_dict()) - {"model_type", "architectures", "transformers_version"}
    new = {key: value for key, value in config.items() if key in shared}
    return dict(
        new, model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"], multi_query=True, num_key_value_heads=1
    )


def describe_layout(config: dict) -> dict:
    """Where the layout of config's model_type comes from, and whether the calibrated merge (and a
    query-head permutation) can be exact on it: what `inspect` shows."""
    layout, model_type = layout_for(config), config.get("model_type")
    if model_type in LAYOUTS:
        source = f"explicit entry for {model_type}"
    elif layout.target:
        source = f"{model_type} converts to {layout.target} (multi-query only: --groups 1)"
    else:
        attention = layout.layer_prefix.format(layer="N") + layout.k.rsplit(".", 1)[0]
        modules = ", ".join(name.rsplit(".", 1)[-1] for name in (layout.q, layout.k, layout.v, layout.o))
        source = f"generic, derived from the model class: attention at {attention} ({modules})"
    return {
        "layout": source,
        "calibrated": layout.calibrated_refusal(config) or "supported",
        "similarity_grouping": layout.grouping_refusal(config) or "supported",
        "refine": layout.refine_barrier or "supported",
    }
