"""mha2gqa's transformers classes for Nemotron-NAS (DeciLM) checkpoints, registered with the Auto classes.

The classes are configuration_decilm.py's and modeling_decilm.py's, the same files write_remote_code copies into a
per-layer child. register() adds them to the Auto classes (model_type "nemotron-nas"), so that eval and uptrain load
such a checkpoint with trust_remote_code=False. It is also mha2gqa's vLLM plugin (entry point group
`vllm.general_plugins`, setup.cfg), which vLLM runs in each of its processes: vLLM builds the model with its own
DeciLMForCausalLM and needs only a config class for "nemotron-nas" whose block_configs answer attribute reads.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from mha2gqa.nemotron_nas.block_format import MODEL_TYPE
from mha2gqa.nemotron_nas.configuration_decilm import NemotronNasConfig
from mha2gqa.nemotron_nas.modeling_decilm import DeciLMForCausalLM, DeciLMModel

__all__ = ["DeciLMForCausalLM", "DeciLMModel", "NemotronNasConfig", "register"]


def register() -> None:
    """Add the classes to transformers' Auto classes (once per process; later calls do nothing). vLLM calls it
    as a general plugin in every process it starts, before it reads a model's config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE in CONFIG_MAPPING:
        return
    AutoConfig.register(MODEL_TYPE, NemotronNasConfig)
    AutoModelForCausalLM.register(NemotronNasConfig, DeciLMForCausalLM)
