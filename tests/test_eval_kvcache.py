"""KV-cache bytes: the live transformers cache after a prefill equals the formula."""

import dataclasses

import pytest
import torch
from tiny_models import MODEL_TYPES, make_tiny_model

from mha2gqa.eval.kvcache import measure_kv_cache
from mha2gqa.eval.model import shape_of


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_measured_equals_formula_and_quarter_kv_heads_is_four_times_smaller(model_type):
    mha = make_tiny_model(model_type)  # 8 heads, 8 kv heads
    gqa = make_tiny_model(model_type, num_key_value_heads=2)  # h/4
    r_mha = measure_kv_cache(mha, shape_of(mha.config), batch=3, tokens=10)
    r_gqa = measure_kv_cache(gqa, shape_of(gqa.config), batch=3, tokens=10)
    for r, kv in ((r_mha, 8), (r_gqa, 2)):
        assert r["match"], r
        assert r["measured_bytes_per_token"] == r["formula_bytes_per_token"]
        assert r["cached_heads"] == [kv]
        assert "warning" not in r
    head_dim = mha.config.head_dim if getattr(mha.config, "head_dim", None) else 64 // 8
    assert r_mha["formula_bytes_per_token"] == 2 * 2 * 8 * head_dim * 4  # 2 * layers * kv * hd * fp32
    assert r_mha["measured_bytes_per_token"] == 4 * r_gqa["measured_bytes_per_token"]


def test_half_precision_halves_the_bytes():
    model = make_tiny_model("llama", num_key_value_heads=4)
    full = measure_kv_cache(model, shape_of(model.config))
    half = measure_kv_cache(model.to(torch.bfloat16), shape_of(model.config))
    assert half["dtype_bytes"] == 2 and half["match"]
    assert half["measured_bytes_per_token"] * 2 == full["measured_bytes_per_token"]


def test_a_cache_holding_more_heads_than_kv_heads_is_reported_loudly():
    # As if the config promised 2 kv heads but the model cached K/V for all 8 (broadcast before caching).
    model = make_tiny_model("llama")
    claimed = dataclasses.replace(shape_of(model.config), kv_heads=2)
    r = measure_kv_cache(model, claimed)
    assert not r["match"]
    assert r["measured_bytes_per_token"] == 4 * r["formula_bytes_per_token"]
    assert "MISMATCH" in r["warning"] and "broadcasts K/V" in r["warning"] and "8 heads" in r["warning"]


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_a_sliding_window_cache_past_its_window_is_no_mismatch(model_type):
    """Mistral with sliding_window 16 and a 32-token prefill keeps fewer positions than it was given: each cached
    position still costs the formula's bytes, the window is said, and nothing is called a mismatch."""
    extra = dict(use_sliding_window=True, max_window_layers=0) if model_type == "qwen2" else {}
    model = make_tiny_model(model_type, num_key_value_heads=2, sliding_window=16, **extra)
    r = measure_kv_cache(model, shape_of(model.config), batch=2, tokens=32)
    assert r["match"] and "warning" not in r, r
    assert r["measured_bytes_per_token"] == r["formula_bytes_per_token"]
    assert r["sliding_window"] == 16 and r["cached_positions"] < 32
    broadcast = measure_kv_cache(model, dataclasses.replace(shape_of(model.config), kv_heads=1), tokens=32)
    assert not broadcast["match"] and "MISMATCH" in broadcast["warning"]  # a real mismatch is still one
