"""transformers classes for Nemotron-NAS (DeciLM) checkpoints with full blocks: transformers' own Llama modules,
each decoder layer built from a LlamaConfig of its own that states that layer's kv heads and MLP width.

register() adds them to the Auto classes (model_type "nemotron-nas"), so AutoModelForCausalLM.from_pretrained
loads such a checkpoint with trust_remote_code=False. It is also mha2gqa's vLLM plugin (entry point group
`vllm.general_plugins`, setup.cfg), which vLLM runs in each of its processes: vLLM builds the model with its own
DeciLMForCausalLM and needs only a config class for "nemotron-nas" whose block_configs answer attribute reads. The weight names are Llama's, the names NVIDIA's
checkpoints and vLLM's loader use (model.layers.N.self_attn.k_proj.weight, ...).
"""

from __future__ import annotations

import dataclasses

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from mha2gqa.nemotron_nas.blocks import (
    MODEL_TYPE,
    PER_BLOCK_KEYS,
    layer_intermediate_sizes,
    layer_kv_heads,
    readable_blocks,
)


@strict
class NemotronNasConfig(LlamaConfig):
    """LlamaConfig plus block_configs (one dict per layer, blocks.py); num_key_value_heads and intermediate_size
    are per block, and the global ones are unused."""

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


class DeciLMModel(LlamaModel):
    """LlamaModel whose layer i is a LlamaDecoderLayer of config.layer_config(i); forward is Llama's."""

    config_class = NemotronNasConfig

    def __init__(self, config: NemotronNasConfig):
        # LlamaModel.__init__ would build every layer from the global config first; its parent's sets the config
        super(LlamaModel, self).__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config.layer_config(i), i) for i in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class DeciLMForCausalLM(LlamaForCausalLM):
    """Llama's causal LM head on DeciLMModel. Named as NVIDIA's class: save_pretrained writes the class's name as
    config.json's architectures, and vLLM picks its loader by that name."""

    config_class = NemotronNasConfig

    def __init__(self, config: NemotronNasConfig):
        super(LlamaForCausalLM, self).__init__(config)
        self.model = DeciLMModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def set_attn_implementation(self, attn_implementation, allow_all_kernels: bool = False):
        """transformers sets the model's config; each layer's own config follows it (layers read theirs)."""
        super().set_attn_implementation(attn_implementation, allow_all_kernels=allow_all_kernels)
        for layer in self.model.layers:
            layer.self_attn.config._attn_implementation_internal = self.config._attn_implementation


def register() -> None:
    """Add the classes to transformers' Auto classes (once per process; later calls do nothing). vLLM calls it
    as a general plugin in every process it starts, before it reads a model's config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE in CONFIG_MAPPING:
        return
    AutoConfig.register(MODEL_TYPE, NemotronNasConfig)
    AutoModelForCausalLM.register(NemotronNasConfig, DeciLMForCausalLM)
