"""The RoPE check that decides whether the calibrated merge may fold key maps reads each function's
own definition from its module's source, so a decorator that swaps the function for another object
(transformers >= 5.25 wraps apply_rotary_pos_emb in a kernels module) neither crashes nor hides it."""

import inspect
import sys

import pytest

from mha2gqa.architecture.generic_layout import _same_body

LLAMA = "transformers.models.llama.modeling_llama"

COPY = '''
import torch


class Wrapped:  # what a kernels-style decorator returns: callable, but not a function
    def __init__(self, function):
        self.function = function

    def __call__(self, *args):
        return self.function(*args)


@Wrapped
def rotate_half(tensor):
    """Another docstring, another argument name in the signature, the same statements."""
    x1 = x[..., : x.shape[-1] // 2]  # a comment the comparison ignores
    x2 = x[
        ..., x.shape[-1] // 2 :
    ]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    return q, k  # no rotation at all
'''


@pytest.fixture
def copied_module(tmp_path, monkeypatch):
    (tmp_path / "modeling_copied_rope.py").write_text(COPY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__("modeling_copied_rope")
    sys.modules.pop("modeling_copied_rope", None)


def test_a_wrapped_copy_of_the_standard_function_is_recognised(copied_module):
    with pytest.raises(TypeError):  # what the object-based comparison died of
        inspect.getsource(copied_module.rotate_half)
    assert _same_body("modeling_copied_rope", LLAMA, "rotate_half")


def test_a_different_body_or_a_missing_definition_is_not_standard(copied_module):
    assert not _same_body("modeling_copied_rope", LLAMA, "apply_rotary_pos_emb")
    assert not _same_body("modeling_copied_rope", LLAMA, "repeat_kv")  # not defined there
