"""--refine-global-precision: the global stage carries out the plan's explicit choice (convert/refine/precision.py);
what `auto` means on a machine is decided by the plan (tests/test_convert_decisions.py)."""

import pytest
import torch

from mha2gqa.convert.options import GlobalPrecision, RefineOptions
from mha2gqa.convert.refine import GlobalFit
from mha2gqa.convert.refine.precision import fit_autocast_dtype
from mha2gqa.runtime.errors import InputError


def test_an_explicit_precision_is_carried_out_as_it_is():
    assert fit_autocast_dtype("float32") is None
    assert fit_autocast_dtype(GlobalPrecision.BFLOAT16) is torch.bfloat16
    assert GlobalFit.of(RefineOptions(global_precision="bfloat16")).autocast is torch.bfloat16


def test_the_global_stage_refuses_an_undecided_auto_instead_of_asking_the_machine():
    with pytest.raises(ValueError, match=r"'auto' reached the global stage undecided.*mha2gqa.convert.decide"):
        GlobalFit.of(RefineOptions())  # the default is auto: only a plan turns it into a value


def test_an_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(
        InputError, match=r"--refine-global-precision 'bf8' is unknown \(valid: auto, float32, bfloat16\)"
    ):
        RefineOptions(global_precision="bf8")
    assert RefineOptions(global_precision="bfloat16").global_precision is GlobalPrecision.BFLOAT16
