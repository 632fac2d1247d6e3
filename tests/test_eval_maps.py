"""Attention maps: one layer's per-head probabilities, model beside reference, saved as a PNG."""

import pytest
import torch
from tiny_models import make_tiny_model, make_tiny_tokenizer

from mha2gqa.errors import InputError
from mha2gqa.eval.attention_maps import attention_maps, plot_attention_maps


def test_maps_are_row_stochastic_causal_and_plotted(tmp_path):
    model, reference = make_tiny_model("llama", num_key_value_heads=2), make_tiny_model("llama", seed=1)
    before = model.config._attn_implementation
    found = attention_maps(model, make_tiny_tokenizer(), "a single man", layer=-1, reference=reference)
    assert model.config._attn_implementation == before  # switched back after the eager forward
    assert found["layer"] == 1
    for maps in found["maps"].values():
        heads, t, t2 = maps.shape
        assert heads == 8 and t == t2 == len(found["tokens"])
        torch.testing.assert_close(maps.sum(-1), torch.ones(heads, t))
        assert torch.triu(maps, diagonal=1).abs().max() == 0  # no query sees a later key
    png = plot_attention_maps(found, tmp_path / "maps.png", {"model": "gqa", "reference": "mha"}, kv_heads=2)
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000


def test_layer_out_of_range_is_refused():
    with pytest.raises(InputError, match="--attention-layer 5 is out of range: the model has 2 layers"):
        attention_maps(make_tiny_model("llama"), make_tiny_tokenizer(), "a man", layer=5)
