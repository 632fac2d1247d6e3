"""eval's speed grid takes every value it is given: 0 repeats, 0 new tokens or an empty batch list is refused
with its rule, never replaced by the preset's value (make_grid read them with `or`, so evaluate(repeats=0)
timed 3 repeats and said nothing)."""

import pytest

from mha2gqa.eval import measurements
from mha2gqa.eval.options import EvalOptions
from mha2gqa.runtime.errors import InputError


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(repeats=0), "--repeats 0 must be at least 1"),
        (dict(new_tokens=0), "--new-tokens 0 must be at least 1"),
        (dict(repeats=-2), "--repeats -2 must be at least 1"),
        (dict(speed_batches=()), "--speed-batches '': every value must be a positive integer"),
        (dict(speed_contexts=()), "--speed-contexts '': every value must be a positive integer"),
    ],
)
def test_a_zero_or_empty_speed_value_is_refused_before_loading(fields, message):
    with pytest.raises(InputError) as caught:
        measurements.validate_all(EvalOptions(speed_preset="cpu", **fields))
    assert str(caught.value) == message


def test_given_values_are_kept_and_unset_ones_come_from_the_preset():
    from mha2gqa.eval import speed

    grid = speed.make_grid("cpu", new_tokens=1, repeats=1)
    preset = speed.PRESETS["cpu"]
    assert (grid.new_tokens, grid.repeats) == (1, 1)
    assert (grid.batches, grid.contexts) == (preset.batches, preset.contexts)
    assert speed.make_grid("cpu", batches=(2,)).repeats == preset.repeats == 3
