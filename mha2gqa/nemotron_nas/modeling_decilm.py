"""The transformers model classes of a Nemotron-NAS (DeciLM) checkpoint with full blocks: transformers' own Llama
modules, each decoder layer built from a LlamaConfig of its own that states that layer's kv heads and MLP width.
Self-contained (torch, transformers and configuration_decilm.py only): mha2gqa registers it (modeling.py), and
write_remote_code copies it into every per-layer child (config.json's auto_map). The weight names are Llama's, the
names NVIDIA's checkpoints and vLLM's loader use (model.layers.N.self_attn.k_proj.weight, ...).
"""

from __future__ import annotations

from torch import nn
from transformers import LlamaForCausalLM, LlamaModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from .configuration_decilm import NemotronNasConfig


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
