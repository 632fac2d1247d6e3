"""--refine-global-precision: what `auto` picks from this machine's bfloat16 speed (convert/refine/precision.py)."""

import pytest
import torch

from mha2gqa.convert.options import GlobalPrecision, RefineOptions
from mha2gqa.convert.refine import precision
from mha2gqa.errors import InputError


@pytest.mark.parametrize(
    ("speedup", "expected"), [(6.8, torch.bfloat16), (2.0, torch.bfloat16), (1.9, None), (0.3, None)]
)
def test_auto_picks_bfloat16_on_a_cpu_only_where_its_products_are_twice_as_fast(monkeypatch, speedup, expected):
    monkeypatch.setattr(precision, "bf16_speedup", lambda: speedup)
    assert precision.fit_autocast_dtype(GlobalPrecision.AUTO, torch.device("cpu")) is expected


def test_an_explicit_precision_is_kept_and_auto_leaves_a_gpu_in_float32(monkeypatch):
    monkeypatch.setattr(precision, "bf16_speedup", lambda: pytest.fail("an explicit choice or a GPU needs no probe"))
    assert precision.fit_autocast_dtype("float32", "cpu") is None
    assert precision.fit_autocast_dtype("bfloat16", "cpu") is torch.bfloat16
    assert precision.fit_autocast_dtype("auto", torch.device("cuda")) is None


def test_the_probe_measures_a_positive_speedup_once_a_process():
    precision.bf16_speedup.cache_clear()
    first = precision.bf16_speedup()
    assert 0 < first < 100
    assert precision.bf16_speedup() == first  # cached: the global stage asks once


def test_an_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(
        InputError, match=r"--refine-global-precision 'bf8' is unknown \(valid: auto, float32, bfloat16\)"
    ):
        RefineOptions(global_precision="bf8")
    assert RefineOptions(global_precision="bfloat16").global_precision is GlobalPrecision.BFLOAT16
