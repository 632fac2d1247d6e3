"""The readers of a Nemotron-NAS config's `block_configs` that every copy of the model code needs: each layer's kv
heads and MLP width, and the blocks as dicts that answer attribute reads. Self-contained (the standard library
only): write_remote_code copies this file, with configuration_decilm.py and modeling_decilm.py, into a model folder
that must load where mha2gqa is not installed.
"""

from __future__ import annotations

MODEL_TYPE = "nemotron-nas"
ARCHITECTURE = "DeciLMForCausalLM"
FFN_MULTIPLE = 256  # the readers round the MLP width up to a multiple of this
# Keys of a Llama config.json that a Nemotron-NAS config states per block instead (NVIDIA's DeciLMConfig sets
# both to None): a uniform value left in would contradict the blocks.
PER_BLOCK_KEYS = ("num_key_value_heads", "intermediate_size")


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """The MLP width every reader derives from ffn_mult (vLLM's and NVIDIA's _ffn_mult_to_intermediate_size)."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return width if width % FFN_MULTIPLE == 0 else width + FFN_MULTIPLE - width % FFN_MULTIPLE


class Settings(dict):
    """One part of a block (its attention, its ffn; the block itself) as a dict that also answers attribute
    reads: vLLM's nemotron_nas.py reads `block.attention.n_heads_in_group` and `hasattr(block.ffn, "ffn_mult")`,
    as NVIDIA's config class's dataclasses allow. Still a plain dict to everything else, so config.json is written
    from it unchanged. A key whose value is null reads as absent, so vLLM takes `ffn.intermediate_size` where
    `ffn_mult` is null, as layer_intermediate_sizes does."""

    def __getattr__(self, name: str):
        if name.startswith("__") or self.get(name) is None:  # dunders: copy and pickle probe for them
            raise AttributeError(f"block_configs entry has no {name!r}")
        return self[name]


def readable_blocks(blocks: list | None) -> list | None:
    """block_configs as Settings (attribute reads at both levels, the readers below unchanged)."""
    if blocks is None:
        return None
    return [
        Settings({key: Settings(part) if isinstance(part, dict) else part for key, part in block.items()})
        if isinstance(block, dict)
        else block
        for block in blocks
    ]


def layer_kv_heads(config: dict) -> list[int]:
    """Each layer's kv heads, as the readers compute them."""
    heads = config["num_attention_heads"]
    return [heads // block["attention"]["n_heads_in_group"] for block in config["block_configs"]]


def layer_intermediate_sizes(config: dict) -> list[int]:
    """Each layer's MLP width: from ffn_mult, or (vLLM reads it where ffn_mult is absent) ffn.intermediate_size."""
    hidden = config["hidden_size"]
    return [
        ffn_mult_to_intermediate_size(block["ffn"]["ffn_mult"], hidden)
        if block["ffn"].get("ffn_mult") is not None
        else block["ffn"]["intermediate_size"]
        for block in config["block_configs"]
    ]
