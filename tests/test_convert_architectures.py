"""Every supported architecture converts to every valid kv-head count and loads cleanly in stock transformers."""

import pytest
import torch
from safetensors import safe_open
from tiny_models import MODEL_TYPES, save_tiny_model
from transformers import AutoModelForCausalLM

from mha2gqa import convert

GROUPS = [4, 2, 1]  # the tiny models have 8 kv heads


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    cache = {}

    def get(model_type):
        if model_type not in cache:
            path = tmp_path_factory.mktemp(model_type)
            save_tiny_model(path, model_type)
            cache[model_type] = path
        return cache[model_type]

    return get


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("groups", GROUPS)
def test_converted_model_loads_runs_and_generates(sources, tmp_path, model_type, groups):
    dst = tmp_path / "out"
    convert(sources(model_type), dst, groups=groups, progress=False)

    model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
    assert model.config.num_key_value_heads == groups
    ids = torch.tensor([[5, 9, 17, 33, 60, 7]])
    logits = model(ids).logits
    assert logits.shape == (1, 6, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 10)

    head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else 8
    with safe_open(dst / "model.safetensors", "pt") as f:
        names = list(f.keys())
        kv_rows = [f.get_slice(n).get_shape()[0] for n in names if n.endswith((".k_proj.weight", ".v_proj.weight"))]
    if model_type == "phi3":
        assert kv_rows == []  # fused qkv_proj: checked by shape below
        assert model.model.layers[0].self_attn.qkv_proj.weight.shape[0] == (8 + 2 * groups) * head_dim
    else:
        assert kv_rows and all(rows == groups * head_dim for rows in kv_rows)
    if model_type == "stablelm":
        norms = [n for n in names if "k_layernorm.norms" in n and n.startswith("model.layers.0.")]
        assert len(norms) == groups
