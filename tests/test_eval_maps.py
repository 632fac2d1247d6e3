"""Attention maps: one layer's per-head probabilities, model beside reference, saved as a PNG."""

import pytest
import torch
from tiny_models import make_tiny_model, make_tiny_tokenizer

from mha2gqa.eval.attention_maps import attention_figure, attention_maps, plot_attention_maps, token_labels
from mha2gqa.runtime.errors import InputError


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


def test_maps_name_their_tokens_and_carry_a_colorbar():
    model, reference = make_tiny_model("llama", num_key_value_heads=2), make_tiny_model("llama", seed=1)
    found = attention_maps(model, make_tiny_tokenizer(), "a single man", layer=0, reference=reference)
    fig = attention_figure(found, {"model": "gqa", "reference": "mha"}, kv_heads=2)
    *panels, bar = fig.axes
    assert len(panels) == 16 and bar.get_ylabel().startswith("attention probability")
    assert bar.get_ylim() == (0.0, 1.0)
    tokens = token_labels(found["tokens"])
    assert "␣single" in tokens or "␣s" in tokens  # sentencepiece's ▁ shown as a visible space
    left, bottom = panels[0], panels[-1]
    assert [t.get_text() for t in left.get_yticklabels()] == tokens  # query tokens down the left
    assert [t.get_text() for t in bottom.get_xticklabels()] == tokens  # key tokens along the bottom
    assert "head 7, kv 1" in bottom.get_title()


def test_layer_out_of_range_is_refused():
    with pytest.raises(InputError, match="--attention-layer 5 is out of range: the model has 2 layers"):
        attention_maps(make_tiny_model("llama"), make_tiny_tokenizer(), "a man", layer=5)
