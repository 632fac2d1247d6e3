"""config.json of a Nemotron-NAS (DeciLM) checkpoint, as NVIDIA writes it and vLLM, SGLang, TensorRT-LLM,
MLX-LM and llama.cpp's `deci` converter read it: a Llama config plus `block_configs`, one per layer, with
`attention.n_heads_in_group` (that layer's kv heads = num_attention_heads / n_heads_in_group) and
`ffn.ffn_mult`, from which every reader derives the MLP width as
`find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)`. Pure: no torch.
"""

from __future__ import annotations

from mha2gqa.nemotron_nas.block_format import (  # noqa: F401 (the format's readers, named here for its users)
    ARCHITECTURE,
    FFN_MULTIPLE,
    MODEL_TYPE,
    PER_BLOCK_KEYS,
    Settings,
    ffn_mult_to_intermediate_size,
    layer_intermediate_sizes,
    layer_kv_heads,
    readable_blocks,
)
from mha2gqa.runtime.errors import InputError


def ffn_mult_for(intermediate_size: int, hidden_size: int) -> float:
    """The ffn_mult that every reader turns back into exactly `intermediate_size`; InputError where none does
    (the readers round up to a multiple of 256, so a width that is not one cannot be stated)."""
    ffn_mult = 3 * intermediate_size / (2 * hidden_size)
    if ffn_mult_to_intermediate_size(ffn_mult, hidden_size) != intermediate_size:
        raise InputError(
            f"intermediate_size={intermediate_size} is not a multiple of {FFN_MULTIPLE}: the Nemotron-NAS format "
            f"states the MLP width as ffn_mult, which its readers round up to a multiple of {FFN_MULTIPLE}, so this "
            "parent cannot be written in it; convert it with a uniform --groups instead"
        )
    return ffn_mult


def block_configs(heads: int, kv_heads_per_layer: list[int], ffn_mult: float) -> list[dict]:
    """One block per layer: attention with its own kv heads, the parent's MLP (no layer skipped or linearised)."""
    return [
        {
            "attention": {"n_heads_in_group": heads // kv_heads, "no_op": False, "replace_with_linear": False},
            "ffn": {"ffn_mult": ffn_mult, "no_op": False, "replace_with_linear": False},
        }
        for kv_heads in kv_heads_per_layer
    ]


def nemotron_nas_config(llama_config: dict, kv_heads_per_layer: list[int]) -> dict:
    """A Llama config.json dict -> the Nemotron-NAS config.json of the same model with these kv heads per layer."""
    heads, hidden = llama_config["num_attention_heads"], llama_config["hidden_size"]
    ffn_mult = ffn_mult_for(llama_config["intermediate_size"], hidden)
    kept = {key: value for key, value in llama_config.items() if key not in PER_BLOCK_KEYS}
    return dict(
        kept,
        model_type=MODEL_TYPE,
        architectures=[ARCHITECTURE],
        block_configs=block_configs(heads, kv_heads_per_layer, ffn_mult),
    )


def validate_blocks(config: dict, path) -> None:
    """Refuse (one line) block_configs that mha2gqa's model class cannot build: one block per layer, each an
    attention whose n_heads_in_group divides the heads and an MLP with a width; no skipped (no_op) or
    linear-replaced parts, which NVIDIA's pruned models use and this class does not implement."""
    blocks, layers, heads = config.get("block_configs"), config.get("num_hidden_layers"), config["num_attention_heads"]
    if not isinstance(blocks, list) or len(blocks) != layers:
        count = len(blocks) if isinstance(blocks, list) else "no list of"
        raise InputError(
            f"{path} has {count} block_configs for num_hidden_layers={layers}: a Nemotron-NAS config needs one "
            "block per layer; use the checkpoint's own config.json"
        )
    for index, block in enumerate(blocks):
        attention, ffn = (block.get(part) if isinstance(block, dict) else None for part in ("attention", "ffn"))
        if not isinstance(attention, dict) or not isinstance(ffn, dict):
            raise InputError(f"{path}: block_configs[{index}] needs an 'attention' and an 'ffn' object")
        for part, settings in (("attention", attention), ("ffn", ffn)):
            for key in ("no_op", "replace_with_linear"):
                if settings.get(key):
                    raise InputError(
                        f"{path}: block_configs[{index}].{part}.{key} is true: mha2gqa's Nemotron-NAS class builds "
                        "full attention and MLP blocks only; load this model with its own code (trust_remote_code)"
                    )
        group = attention.get("n_heads_in_group")
        if not isinstance(group, int) or isinstance(group, bool) or group < 1 or heads % group:
            raise InputError(
                f"{path}: block_configs[{index}].attention.n_heads_in_group={group!r} must be a positive integer "
                f"that divides num_attention_heads={heads}"
            )
        width = ffn.get("ffn_mult") if ffn.get("ffn_mult") is not None else ffn.get("intermediate_size")
        if not isinstance(width, (int, float)) or isinstance(width, bool) or width <= 0:
            raise InputError(f"{path}: block_configs[{index}].ffn needs a positive ffn_mult (or intermediate_size)")
