"""The transformers config class of a Nemotron-NAS (DeciLM) checkpoint with full blocks. Self-contained
(transformers, huggingface_hub and block_format.py only): mha2gqa registers it (modeling.py), and
write_remote_code copies it into every per-layer child, where config.json's auto_map names it, so that
`AutoModelForCausalLM.from_pretrained(DST, trust_remote_code=True)` loads the child without mha2gqa.
"""

from __future__ import annotations

import dataclasses

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from .block_format import MODEL_TYPE, PER_BLOCK_KEYS, layer_intermediate_sizes, layer_kv_heads, readable_blocks


@strict
class NemotronNasConfig(LlamaConfig):
    """LlamaConfig plus block_configs (one dict per layer, block_format.py); num_key_value_heads and
    intermediate_size are per block, and the global ones are unused."""

    model_type = MODEL_TYPE
    block_configs: list | None = None

    def __post_init__(self, **kwargs):
        # attribute reads for vLLM (block.attention.n_heads_in_group); still dicts, so to_dict writes them as read
        self.block_configs = readable_blocks(self.block_configs)
        super().__post_init__(**kwargs)

    def to_dict(self) -> dict:
        """What save_pretrained writes: without the global num_key_value_heads and intermediate_size, which the
        blocks state per layer (a uniform value would contradict them; NVIDIA's config class sets both to None)."""
        values = super().to_dict()
        for key in PER_BLOCK_KEYS:
            values.pop(key, None)
        return values

    def layer_config(self, layer: int) -> LlamaConfig:
        """The LlamaConfig layer `layer` is built from: this config's values with that block's kv heads and width."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(LlamaConfig) if hasattr(self, f.name)}
        blocks = self.to_dict()
        values.update(
            num_key_value_heads=layer_kv_heads(blocks)[layer],
            intermediate_size=layer_intermediate_sizes(blocks)[layer],
        )
        config = LlamaConfig(**values)
        config._attn_implementation_internal = self._attn_implementation
        return config
